"""Shared fixtures: tiny random models of each supported architecture, built once per session."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
# Every engine in the tests checks KV-cache integrity after every step.
os.environ["PAGEDLLM_DEBUG"] = "1"
# Engines compile their decode step only where a test asks (compile=True): compiled by
# default, every engine the suite starts would add 10-60 s (runner/compile_choice.py).
os.environ.setdefault("PAGEDLLM_COMPILE", "0")
# Nor do they fault their KV pools in ahead: each would spend ~0.5-1.5 s of its start on the
# first 512 MB (runner/kv_prefault.py); tests/worker/test_kv_prefault.py turns it on.
os.environ.setdefault("PAGEDLLM_KV_PREFAULT", "0")

import process_guard
from model_utils import make_tiny_model
from pooling_server import pooling_server  # noqa: F401 - the session pooling server fixture
from session_server import server  # noqa: F401 - the session server fixture
from tiers import mark_slow_tier

VARIANTS = {
    "": {},
    # Llama 3 RoPE scaling, with an original context short enough that it matters here.
    "llama3": {
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    },
    "tied-bias": {"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True},
    # Phi-4-mini's LongRoPE over 3/4 of each head (12 of 16 dims: 6 factors per set). The
    # original context (512) is above the shared test's max_model_len, so the short factors
    # apply; factor 1024 / 512 scales cos/sin by sqrt(1 + ln 2 / ln 512).
    "longrope": {
        "partial_rotary_factor": 0.75,
        "original_max_position_embeddings": 512,
        "rope_parameters": {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0, 1.25, 1.5, 2.0, 3.0, 4.0],
            "long_factor": [2.0, 3.0, 4.5, 6.0, 8.0, 12.0],
        },
    },
    # A context shorter than the tests' usual max_model_len (a draft that cannot keep up).
    "short-context": {"max_position_embeddings": 128},
    # A window shorter than most prompts, so windowed layers drop blocks.
    "window24": {"sliding_window": 24},
    # Qwen2's windowed upper layers: layer 0 full, layer 1 windowed (two KV cache groups).
    "hybrid24": {"use_sliding_window": True, "sliding_window": 24, "max_window_layers": 1},
    # Tensor-parallel shapes: one KV head (replicated over the ranks) or four, and a
    # vocabulary no rank count divides.
    "kv1-vocab509": {"num_key_value_heads": 1, "vocab_size": 509},
    "kv4-vocab509": {"num_key_value_heads": 4, "vocab_size": 509},
}


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    built: dict[str, Path] = {}

    def build(variant: str = "LlamaForCausalLM") -> Path:
        """`variant`: an architecture name, optionally with a VARIANTS suffix (`...:llama3`)."""
        if variant not in built:
            architecture, _, extra = variant.partition(":")
            directory = tmp_path_factory.mktemp(variant.replace(":", "-"))
            built[variant] = make_tiny_model(architecture, directory, **VARIANTS[extra])
        return built[variant]

    return build


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory) -> Path:
    return tiny_model_factory("LlamaForCausalLM")


@pytest.fixture(scope="session")
def hf_default_model():
    """Transformers' model on the default model's GGUF (dequantized to fp32: as the engine
    reads it without quantization=), loaded once for every test that compares with it."""
    import torch
    from transformers import AutoModelForCausalLM

    from pagedllm.model.loader import default_model_path

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )


_TIE_REPORT: list[str] = []


@pytest.fixture
def pagedllm_log(caplog):
    """The package logger's warnings and errors (it does not propagate to the root logger)."""
    logger = logging.getLogger("pagedllm")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="pagedllm"):
            yield caplog
    finally:
        logger.removeHandler(caplog.handler)


@pytest.fixture
def report_ties(request):
    """Record how many numerical ties a greedy comparison met; printed in the summary."""

    def report(count: int, compared: int) -> None:
        _TIE_REPORT.append(f"{request.node.nodeid}: {count} tie(s) in {compared} sequences")

    return report


def pytest_terminal_summary(terminalreporter):
    if _TIE_REPORT:
        terminalreporter.section("greedy comparisons: numerical ties (top-2 logits within 1e-4)")
        for line in _TIE_REPORT:
            terminalreporter.write_line(line)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """The slow tier (tests/tiers.py) marked before `-m "not slow"` selects."""
    mark_slow_tier(items)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # Before the test's fixtures are set up: a fast test's fixture must not start processes.
    process_guard.fast_test = None if item.get_closest_marker("slow") else item.nodeid


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item):
    process_guard.fast_test = None
