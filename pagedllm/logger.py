"""The package logger: INFO lines to stderr unless the application configured logging itself."""

from __future__ import annotations

import logging


def init_logger() -> logging.Logger:
    logger = logging.getLogger("pagedllm")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(
            logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s", "%m-%d %H:%M:%S")
        )
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger
