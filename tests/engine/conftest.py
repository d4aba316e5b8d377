"""Tokenizers the detokenization tests share (module-scoped: building one takes a while)."""

from __future__ import annotations

import pytest
from model_utils import make_tiny_tokenizer
from tokenizer_utils import make_sentencepiece_style_tokenizer

from pagedllm.model.gguf_loader import load_gguf_tokenizer
from pagedllm.model.loader import default_model_path


@pytest.fixture(scope="module")
def smollm2():
    return load_gguf_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_tokenizer()


@pytest.fixture(scope="module")
def sentencepiece_style():
    return make_sentencepiece_style_tokenizer()
