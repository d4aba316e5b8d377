"""`pagedllm generate` end to end on a tiny model, its flags mapping to engine arguments, and
every subcommand's flags explaining themselves (help, defaults, sections, --help=SECTION)."""

import argparse
import dataclasses
import logging

import pytest

from pagedllm import LLM
from pagedllm.config import EngineArgs
from pagedllm.entrypoints.cli import build_parser, main
from pagedllm.entrypoints.engine_flags import engine_args_from
from pagedllm.entrypoints.flag_help import HelpAction


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


def _subcommands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("pagedllm",)):
    """(command path, parser) of `pagedllm` and of every subcommand, nested ones included."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _subcommands(sub, (*path, name))


def _flags(parser: argparse.ArgumentParser):
    return [
        action
        for action in parser._actions
        if not isinstance(action, (argparse._SubParsersAction, HelpAction))
    ]


def _rendered(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The flag's entry in `--help`, on one line."""
    return " ".join(parser._get_formatter()._format_action(action).split())


ALL_SUBCOMMANDS = list(_subcommands(build_parser()))


def test_every_engine_flag_has_help():
    serve = dict(ALL_SUBCOMMANDS)[("pagedllm", "serve")]
    engine = {f.name for f in dataclasses.fields(EngineArgs)}
    helps = {action.dest: action.help for action in _flags(serve) if action.dest in engine}
    assert set(helps) == engine
    assert all(helps.values()), [name for name, text in helps.items() if not text]


def test_subcommands_are_walked():
    names = {" ".join(path) for path, _ in ALL_SUBCOMMANDS}
    assert {"pagedllm serve", "pagedllm generate", "pagedllm proxy"} <= names
    assert {"pagedllm bench throughput", "pagedllm bench latency", "pagedllm bench serve"} <= names


@pytest.mark.parametrize(
    "path,parser", ALL_SUBCOMMANDS, ids=[" ".join(p) for p, _ in ALL_SUBCOMMANDS]
)
def test_every_flag_has_help_with_its_default(path, parser):
    """Every flag and positional of every subcommand (later ones too) says what it does, and
    one whose default is set says it; a default of None or False is never printed as such."""
    missing = [a.dest for a in _flags(parser) if not a.help or a.help == argparse.SUPPRESS]
    assert not missing, f"{' '.join(path)}: flags without help: {missing}"
    silent = [
        a.option_strings[-1]
        for a in _flags(parser)
        if a.option_strings
        and a.default not in (None, argparse.SUPPRESS)
        and a.default is not False
        and "default:" not in _rendered(parser, a).lower()
    ]
    assert not silent, f"{' '.join(path)}: flags whose help hides their default: {silent}"
    text = parser.format_help()
    assert "(default: None)" not in text and "%(" not in text


def test_default_printed_is_the_flags_own():
    serve = dict(ALL_SUBCOMMANDS)[("pagedllm", "serve")]
    actions = {a.dest: a for a in _flags(serve)}
    assert _rendered(serve, actions["max_num_seqs"]).endswith("(default: 256)")
    assert _rendered(serve, actions["allowed_origins"]).endswith('(default: ["*"])')
    assert _rendered(serve, actions["enable_prefix_caching"]).endswith("(default: True)")
    assert _rendered(serve, actions["enable_lora"]).endswith("(default: False)")
    # Said in words where the help says it, not appended again.
    assert _rendered(serve, actions["max_model_len"]).endswith("(default: the model's)")
    assert _rendered(serve, actions["max_model_len"]).count("default") == 1
    bench = dict(ALL_SUBCOMMANDS)[("pagedllm", "bench", "serve")]
    rate = next(a for a in _flags(bench) if a.dest == "request_rate")
    assert _rendered(bench, rate).endswith("(default: inf)")


def _help_output(argv, capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)
    captured = capsys.readouterr()
    return exit_.value.code, captured.out, captured.err


def test_help_shows_sections_in_order(capsys):
    code, out, _ = _help_output(["serve", "--help"], capsys)
    assert code == 0
    titles = [line[:-1] for line in out.splitlines() if line and line[0] != " " and line[-1] == ":"]
    assert titles[:3] == ["positional arguments", "options", "frontend"]
    assert titles.index("model") < titles.index("cache") < titles.index("scheduler")
    assert {"tenants", "tls", "lora", "speculative", "kv-transfer", "parallel"} <= set(titles)


@pytest.mark.parametrize("name", ["cache", "CacheConfig", "CACHE"])
def test_help_section_prints_that_section_only(name, capsys):
    code, out, _ = _help_output(["serve", f"--help={name}"], capsys)
    assert code == 0
    assert out.startswith("cache:")
    assert "--block-size" in out and "--kv-cache-dtype" in out and "(default: 16)" in out
    assert "--max-num-seqs" not in out and "--host" not in out and "usage" not in out


def test_help_lists_sections_and_searches_flags(capsys):
    code, out, _ = _help_output(["serve", "--help=listgroup"], capsys)
    assert code == 0
    listed = [line.split(":")[0] for line in out.splitlines()]
    assert {"frontend", "model", "cache", "scheduler", "lora", "tls", "tenants"} <= set(listed)
    code, out, _ = _help_output(["serve", "--help=max-num"], capsys)
    assert code == 0
    assert "--max-num-seqs" in out and "--max-num-queued-tokens" in out and "--host" not in out
    code, out, _ = _help_output(["bench", "latency", "--help=cache"], capsys)
    assert code == 0 and "--block-size" in out and "--batch-size" not in out


def test_help_for_an_unknown_section_is_a_clear_error(capsys):
    code, out, err = _help_output(["serve", "--help=nonsense"], capsys)
    assert code == 2 and out == ""
    assert "--help=nonsense: no section and no flag named like it" in err
    assert "cache" in err and "frontend" in err


def test_plain_help_still_works(capsys):
    for argv in (["--help"], ["serve", "-h"], ["bench", "--help"], ["proxy", "--help"]):
        code, out, _ = _help_output(argv, capsys)
        assert code == 0 and out.startswith("usage: pagedllm"), argv


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
