"""What a checkpoint quantization method says about itself: the base of the registry.

A `CheckpointMethod` reads a checkpoint's `quantization_config` (config.json) and names its
scheme; `refusal` says why a scheme is not served (None when it is). Each method lives in a
file of its own (`gptq.py`, `awq.py`, ...) and is listed in `registry.py`.
"""

from __future__ import annotations

from typing import Any


class CheckpointMethod:
    """A checkpoint format stored quantized, named as `quant_method` names it."""

    name: str = ""
    served: str = "nothing yet"  # the schemes pagedllm serves, in words

    def scheme(self, config: dict[str, Any]) -> str:
        """The checkpoint's scheme in words (bits, groups, ...), for messages and logs."""
        return self.name

    def refusal(self, config: dict[str, Any]) -> str | None:
        """Why this checkpoint's scheme is not served, or None when it is."""
        return f"{self.name} checkpoints are not served yet"


def config_int(config: dict[str, Any], names: tuple[str, ...], default: int) -> int:
    """The integer under the first of `names` the config holds (`default` when none is):
    a present null or a word is a ValueError naming the field, which the registry turns into
    a refusal rather than a traceback."""
    for name in names:
        if name in config:
            return _as_int(name, config[name])
    return default


def _as_int(name: str, value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    raise ValueError(f"{name} {value!r} is not an integer")


def as_dict(quantization_config: Any) -> dict[str, Any]:
    """A config's `quantization_config` as a plain dict (Transformers may give an object)."""
    if isinstance(quantization_config, dict):
        return dict(quantization_config)
    to_dict = getattr(quantization_config, "to_dict", None)
    return dict(to_dict()) if callable(to_dict) else dict(vars(quantization_config))
