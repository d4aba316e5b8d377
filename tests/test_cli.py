"""`pagedllm generate` end to end on a tiny model, and its flags mapping to engine arguments."""

import dataclasses
import logging

import pytest

from pagedllm import LLM
from pagedllm.config import EngineArgs
from pagedllm.entrypoints.cli import build_parser, main
from pagedllm.entrypoints.engine_flags import engine_args_from


def test_generate_prints_the_completion(tiny_llama, capsys):
    code = main(
        [
            "generate",
            "--model",
            str(tiny_llama),
            "--prompt",
            "What is the capital",
            "--max-tokens",
            "6",
            "--max-model-len",
            "64",
            "--kv-cache-memory",
            "1MiB",
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out.strip("\n")
    llm = LLM(str(tiny_llama), max_model_len=64)
    from pagedllm import SamplingParams

    expected = llm.chat(
        [{"role": "user", "content": "What is the capital"}],
        SamplingParams(temperature=0, max_tokens=6),
        use_tqdm=False,
    )
    assert printed == expected[0].outputs[0].text


def test_engine_flags_use_vllm_names():
    args = build_parser().parse_args(
        [
            "generate",
            "--prompt",
            "x",
            "--max-num-seqs",
            "8",
            "--max-num-batched-tokens",
            "512",
            "--kv-cache-memory",
            "4GiB",
            "--block-size",
            "32",
            "--dtype",
            "bfloat16",
            "--max-model-len",
            "1024",
            "--skip-tokenizer-init",
        ]
    )
    engine_args = engine_args_from(args)
    assert engine_args == EngineArgs(
        max_num_seqs=8,
        max_num_batched_tokens=512,
        kv_cache_memory="4GiB",
        block_size=32,
        dtype="bfloat16",
        max_model_len=1024,
        skip_tokenizer_init=True,
    )


def test_lora_engine_flags_use_vllm_names():
    flags = ["--enable-lora", "--max-loras", "4", "--max-lora-rank", "8", "--max-cpu-loras", "6"]
    args = build_parser().parse_args(["generate", "--prompt", "x", *flags])
    assert engine_args_from(args) == EngineArgs(
        enable_lora=True, max_loras=4, max_lora_rank=8, max_cpu_loras=6
    )
    defaults = engine_args_from(build_parser().parse_args(["serve"]))
    assert (defaults.enable_lora, defaults.max_loras, defaults.max_lora_rank) == (False, 1, 16)
    assert defaults.max_cpu_loras is None


def test_bad_lora_flag_value_is_a_clear_error(tiny_llama, capsys):
    flags = ["--enable-lora", "--max-loras", "2", "--max-cpu-loras", "1"]
    code = main(["generate", "--model", str(tiny_llama), "--prompt", "x", *flags])
    assert code == 2
    assert "max_cpu_loras must be an integer >= max_loras (2)" in capsys.readouterr().err


def test_every_engine_flag_has_help():
    engine = next(g for g in build_parser()._subparsers._group_actions[0].choices["serve"]
                  ._action_groups if g.title == "engine")  # fmt: skip
    helps = {action.dest: action.help for action in engine._group_actions}
    assert set(helps) == {field.name for field in dataclasses.fields(EngineArgs)}
    assert all(helps.values()), [name for name, text in helps.items() if not text]


def test_distributed_executor_backend_is_checked():
    args = build_parser().parse_args(
        ["generate", "--prompt", "x", "--distributed-executor-backend", "uni"]
    )
    assert engine_args_from(args).distributed_executor_backend == "uni"
    with pytest.raises(ValueError, match="distributed_executor_backend must be one of"):
        EngineArgs(distributed_executor_backend="threads")
    with pytest.raises(ValueError, match="'uni' runs one worker"):
        EngineArgs(distributed_executor_backend="uni", tensor_parallel_size=2)
    # Unset: one worker in process, several as processes on this host (vLLM's default).
    assert EngineArgs().parallel_config().distributed_executor_backend == "uni"
    several = EngineArgs(tensor_parallel_size=2, pipeline_parallel_size=2)
    assert several.parallel_config().distributed_executor_backend == "mp"


def test_bad_flag_value_is_a_clear_error(tiny_llama, capsys):
    code = main(["generate", "--model", str(tiny_llama), "--prompt", "x", "--block-size", "0"])
    assert code == 2
    assert "block_size must be a positive integer" in capsys.readouterr().err


def test_start_up_logs_kv_cache_size_and_concurrency(tiny_llama, caplog):
    logger = logging.getLogger("pagedllm")
    logger.addHandler(caplog.handler)
    try:
        LLM(str(tiny_llama), max_model_len=100, block_size=10, kv_cache_memory="64KiB")
    finally:
        logger.removeHandler(caplog.handler)
    # 2 layers x 2 (k, v) x 2 kv heads x 16 dims x 4 bytes x 10 tokens = 5120 bytes a block
    assert "KV cache: 11 blocks of 10 tokens (110 tokens" in caplog.text
    assert "max concurrency at max_model_len=100: 1.10x" in caplog.text


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_dtype_reaches_weights_and_cache(tiny_llama, dtype):
    import torch

    from pagedllm import SamplingParams

    llm = LLM(str(tiny_llama), dtype=dtype, max_model_len=64)
    runner = llm.llm_engine.engine_core.model_executor.driver_worker.model_runner
    expected = getattr(torch, dtype)
    assert runner.kv_caches[0][0].dtype == expected
    assert all(p.dtype == expected for p in runner.model.parameters())
    out = llm.generate(
        {"prompt_token_ids": [3, 4, 5]},
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        use_tqdm=False,
    )
    assert len(out[0].outputs[0].token_ids) == 8


def test_periodic_stats_line(tiny_llama, caplog):
    from pagedllm import SamplingParams

    llm = LLM(str(tiny_llama), max_model_len=64)
    llm.llm_engine.stat_logger.interval_s = 0.0
    logger = logging.getLogger("pagedllm")
    logger.addHandler(caplog.handler)
    try:
        llm.generate(
            {"prompt_token_ids": [5] * 10},
            SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
            use_tqdm=False,
        )
    finally:
        logger.removeHandler(caplog.handler)
    assert "Avg generation throughput" in caplog.text and "KV cache usage" in caplog.text
    quiet = LLM(str(tiny_llama), max_model_len=64, disable_log_stats=True)
    assert quiet.llm_engine.stat_logger is None
