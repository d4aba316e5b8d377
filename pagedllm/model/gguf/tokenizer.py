"""The tokenizer stored in a GGUF file, chat template included (`load_gguf_tokenizer`).

This module owns converting the file's vocabulary into a `transformers` tokenizer (the
conversion is Transformers' own) and caching the result on disk, since converting takes
seconds.
"""

from __future__ import annotations

import os

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from pagedllm.model.gguf.cache import cache_dir_for, save_atomically
from pagedllm.model.gguf.reader import get_value, open_gguf

# Bump when the conversion changes, so cached tokenizers are rebuilt.
_TOKENIZER_CACHE_VERSION = "1"


def load_gguf_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """Build the tokenizer stored in GGUF file ``path``, with its chat template.

    Converting the GGUF vocabulary takes seconds, so the converted tokenizer is saved
    under the cache directory, keyed by the file's path, size and mtime.
    """
    _check_magic(path)
    cache_dir = cache_dir_for(path, "gguf-tokenizers", _TOKENIZER_CACHE_VERSION)
    if os.path.isfile(os.path.join(cache_dir, "tokenizer_config.json")):
        return AutoTokenizer.from_pretrained(cache_dir, local_files_only=True)
    tokenizer = _convert_gguf_tokenizer(path)
    save_atomically(cache_dir, tokenizer.save_pretrained)
    return tokenizer


def _convert_gguf_tokenizer(path: str) -> PreTrainedTokenizerBase:
    directory, filename = os.path.split(os.path.abspath(path))
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=filename, local_files_only=True)
    if not getattr(tokenizer, "chat_template", None):
        # transformers maps tokenizer.chat_template today; keep the guarantee
        # even if a release stops doing so.
        template = get_value(open_gguf(path), "tokenizer.chat_template")
        if template:
            tokenizer.chat_template = str(template)
    return tokenizer


def _check_magic(path: str) -> None:
    # Cheap early check: without it transformers fails deep inside with an
    # error that does not say the file is the problem.
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{path}: not a valid GGUF file: bad magic {magic!r}")
