"""`speculative_config`: vLLM's keys, parsed from a dict or JSON; every inconsistent setting is
an error naming it, before any model is loaded (or, for those that need the models, when the
engine config is built); the flag reaches the engine; the counters reach /metrics and the
periodic log line."""

from __future__ import annotations

import argparse
import logging

import pytest

from pagedllm import LLM
from pagedllm.config import EngineArgs
from pagedllm.core.messages import EngineCoreOutputs
from pagedllm.entrypoints.engine_flags import add_engine_args, engine_args_from
from pagedllm.metrics.core.logger import StatLogger
from pagedllm.metrics.frontend.prometheus import PrometheusMetrics
from pagedllm.metrics.stats import EngineStats
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.metrics import SpecDecodeCounts, SpecDecodingStats


def test_parse_from_dict_and_json():
    config = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (5, 5)
    config = SpeculativeConfig.parse(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    )
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (4, 4)
    assert SpeculativeConfig.parse({"method": "suffix"}).num_speculative_tokens == 24
    assert SpeculativeConfig.parse(None) is None
    assert not config.uses_draft_model and config.num_lookahead_tokens == 0
    draft = SpeculativeConfig("draft_model", 4, model="/some/path")
    assert draft.num_lookahead_tokens == 4


@pytest.mark.parametrize(
    "value, message",
    [
        ("{not json", "not valid JSON"),
        ([1, 2], "must be a dict"),
        ({"method": "mlp_speculator", "num_speculative_tokens": 2}, "method must be one of"),
        ({"method": "ngram"}, "num_speculative_tokens is required"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 1_000_000}, "must be at most 128"),
        ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "unknown"),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 5,
                "prompt_lookup_max": 3,
            },
            "prompt_lookup_min (5) must not exceed prompt_lookup_max (3)",
        ),
        ({"method": "suffix", "prompt_lookup_min": 2}, "applies to method 'ngram' only"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "'medusa'] only"),
        ({"method": "self_quantized", "num_speculative_tokens": 2}, "quantization"),
        (
            {"method": "self_quantized", "num_speculative_tokens": 2, "quantization": "fp4"},
            "quantization",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0},
            "disable_by_batch_size",
        ),
        ({"method": "suffix", "suffix_decoding_min_token_prob": 2.0}, "min_token_prob"),
        ({"method": "suffix", "suffix_decoding_max_spec_factor": -1}, "max_spec_factor"),
        ({"method": "suffix", "suffix_decoding_max_cached_requests": -1}, "cached_requests"),
    ],
)
def test_bad_settings_name_themselves(value, message):
    with pytest.raises(ValueError, match="speculative_config") as error:
        EngineArgs(speculative_config=value)
    assert message in str(error.value)


def test_settings_that_need_the_models(tiny_llama, tiny_model_factory, tmp_path):
    def refused(message, **engine_args):
        with pytest.raises(ValueError, match=message):
            LLM(str(tiny_llama), max_model_len=256, kv_cache_memory="8MiB", **engine_args)

    other_vocabulary = tiny_model_factory("LlamaForCausalLM:kv1-vocab509")
    refused(
        "vocabulary of 509 tokens, the target 512",
        speculative_config={
            "method": "draft_model",
            "model": str(other_vocabulary),
            "num_speculative_tokens": 2,
        },
    )
    short = tiny_model_factory("LlamaForCausalLM:short-context")
    refused(
        r"draft model's context \(128 tokens\) is shorter than max_model_len=256",
        speculative_config={
            "method": "draft_model",
            "model": str(short),
            "num_speculative_tokens": 2,
        },
    )
    refused(
        "not a .gguf file",
        speculative_config={
            "method": "self_quantized",
            "quantization": "gguf",
            "num_speculative_tokens": 2,
        },
    )
    refused(
        "already runs with quantization='int8'",
        quantization="int8",
        speculative_config={
            "method": "self_quantized",
            "quantization": "int8",
            "num_speculative_tokens": 2,
        },
    )
    windowed = tiny_model_factory("MistralForCausalLM:window24")
    with pytest.raises(ValueError, match="sliding-window"):
        LLM(
            str(windowed),
            max_model_len=256,
            kv_cache_memory="8MiB",
            speculative_config={
                "method": "draft_model",
                "model": str(windowed),
                "num_speculative_tokens": 2,
            },
        )


def test_a_draft_models_whole_kv_is_sized_into_every_ranks_pool(tiny_llama, tiny_model_factory):
    """A draft model runs whole on the sampling rank: its KV of every head and layer comes
    on top of each rank's share of the target's (every rank holds the same blocks)."""
    from pagedllm.core.engine_config import kv_bytes_per_block, load_engine_config

    draft = {"method": "draft_model", "model": str(tiny_model_factory("Qwen2ForCausalLM"))}
    common = dict(model=str(tiny_llama), max_model_len=64, kv_cache_memory="1MiB")
    for layout in ({"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}):
        spec = {**draft, "num_speculative_tokens": 2}
        _, _, config = load_engine_config(
            EngineArgs(**common, **layout, speculative_config=spec), log=False
        )
        cache = config.cache_config
        per_block = kv_bytes_per_block(
            config.model_config, cache.block_size, cache.cache_dtype, config.parallel_config
        ) + kv_bytes_per_block(config.draft_model_config, cache.block_size, cache.cache_dtype)
        assert cache.num_blocks == 1024**2 // per_block


def test_flag_reaches_the_engine_args():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    namespace = parser.parse_args(
        ["--speculative-config", '{"method": "suffix", "num_speculative_tokens": 6}']
    )
    args = engine_args_from(namespace)
    assert args.speculative_config == SpeculativeConfig("suffix", 6)
    assert "speculative" in parser.format_help()


def _stats(counts: SpecDecodeCounts | None) -> EngineStats:
    return EngineStats(1, 0, 0, 0, 0.0, 0, 0, 0, 0, spec_decode=counts)


def test_counters_reach_metrics_and_the_log_line(caplog):
    stats = SpecDecodingStats.for_config(SpeculativeConfig("ngram", 3))
    stats.observe(3, 2)
    stats.observe(3, 0)
    first = stats.snapshot()
    assert first == SpecDecodeCounts(2, 6, 2, (1, 1, 0))
    assert first.mean_acceptance_length == 2.0
    stats.observe(2, 2)
    second = stats.snapshot()
    metrics = PrometheusMetrics("m", 128)
    metrics.on_step([], [], _stats(first), now=0.0)
    metrics.on_step([], [], _stats(second), now=1.0)
    text = metrics.render().decode()
    assert 'spec_decode_num_drafts_total{engine="0",model_name="m"} 3.0' in text
    assert 'spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 8.0' in text
    assert 'spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 4.0' in text
    assert (
        'spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"}'
        " 2.0" in text
    )
    assert SpecDecodeCounts.sum([first, None, second]) == SpecDecodeCounts(5, 14, 6, (3, 3, 0))
    logger = StatLogger(interval_s=0.0)
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        logger.record(EngineCoreOutputs([], _stats(second)))
    assert "Mean acceptance length: 2.33" in caplog.text
