"""`--config FILE.yaml`: the file sets flags, the command line overrides it, unknown keys and
badly typed values are errors naming them. Parse-only: no engine starts."""

from __future__ import annotations

import pytest
import yaml

from pagedllm.entrypoints.cli import build_parser
from pagedllm.entrypoints.engine_flags import engine_args_from


@pytest.fixture
def config(tmp_path):
    def write(data) -> str:
        path = tmp_path / "config.yaml"
        path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
        return str(path)

    return write


def parse(*argv):
    return build_parser().parse_args(list(argv))


def parse_error(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exit_:
        parse(*argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err


SERVE_CONFIG = {
    "max-num-seqs": 8,
    "max_model_len": 1024,
    "kv-cache-memory": "64MiB",
    "enable-prefix-caching": False,
    "enable_log_requests": True,
    "served-model-name": ["alpha", "beta"],
    "allowed-origins": ["https://a.example"],
    "api-key": ["k1", "k2"],
    "port": 9001,
    "request-body-timeout": 2.5,
    "speculative-config": {"method": "ngram", "num_speculative_tokens": 3},
}


def test_config_sets_serve_and_engine_flags(config):
    path = config(SERVE_CONFIG)
    args = parse("serve", "MODEL", "--config", path)
    assert args.model_positional == "MODEL"  # not taken by --served-model-name's list
    assert (args.port, args.request_body_timeout, args.enable_log_requests) == (9001, 2.5, True)
    assert args.served_model_name == ["alpha", "beta"]
    assert args.allowed_origins == ["https://a.example"]
    assert args.api_key == ["k1", "k2"]
    engine = engine_args_from(args)
    assert (engine.max_num_seqs, engine.max_model_len, engine.kv_cache_memory) == (
        8,
        1024,
        "64MiB",
    )
    assert engine.enable_prefix_caching is False
    assert engine.speculative_config.num_speculative_tokens == 3


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--config", "{path}", "--max-num-seqs", "4", "--api-key", "k3", "--port=1"],
        ["serve", "--max-num-seqs", "4", "--api-key", "k3", "--port=1", "--config={path}"],
        ["serve", "--port", "1", "--config", "{path}", "MODEL", "--max-num-seqs=4", "--api-key=k3"],
    ],
)
def test_command_line_overrides_config(config, argv):
    path = config(SERVE_CONFIG)
    args = parse(*(arg.replace("{path}", path) for arg in argv))
    assert engine_args_from(args).max_num_seqs == 4
    assert args.port == 1
    assert args.api_key == ["k3"]  # replaces the file's keys, not added to them
    assert args.served_model_name == ["alpha", "beta"]  # not on the command line: the file's


def test_switch_off_in_config_on_in_command_line(config):
    path = config({"enable-prefix-caching": True, "no-enable-lora": True})
    args = parse("generate", "--prompt", "x", "--config", path, "--no-enable-prefix-caching")
    assert args.enable_prefix_caching is False and args.enable_lora is False


def test_unknown_keys_are_one_error_naming_them(config, capsys):
    path = config({"max-num-seqs": 2, "max-num-seq": 3, "bogus_flag": 1})
    err = parse_error(capsys, "serve", "--config", path)
    assert "unknown flags for `pagedllm serve`: max-num-seq, bogus_flag" in err
    # A flag of another subcommand is unknown here too.
    err = parse_error(capsys, "generate", "--prompt", "x", "--config", config({"port": 80}))
    assert "unknown flags for `pagedllm generate`: port" in err


@pytest.mark.parametrize(
    "data,message",
    [
        ({"max-num-seqs": "many"}, "argument --max-num-seqs: invalid int value: 'many'"),
        ({"request_body_timeout": "soon"}, "argument --request-body-timeout: invalid float"),
        ({"ssl-cert-reqs": 7}, "argument --ssl-cert-reqs: invalid choice: 7"),
        ({"allowed-origins": "https://a"}, "argument --allowed-origins: expected a JSON list"),
        ({"enable-prefix-caching": "yes"}, "--enable-prefix-caching is a switch: give true or"),
        ({"enable-log-requests": 1}, "--enable-log-requests is a switch"),
        ({"port": None}, "--port needs a value, got null"),
    ],
)
def test_badly_typed_value_names_the_flag(config, capsys, data, message):
    assert message in parse_error(capsys, "serve", "--config", config(data))


@pytest.mark.parametrize(
    "content,message",
    [
        ("- max-num-seqs\n", "expected a mapping of flag names to values"),
        ("max-num-seqs: [1\n", "not valid YAML"),
    ],
)
def test_bad_files_are_errors(config, capsys, content, message):
    assert message in parse_error(capsys, "serve", "--config", config(content))


def test_missing_file_and_two_files_are_errors(config, capsys, tmp_path):
    assert "No such file" in parse_error(capsys, "serve", "--config", str(tmp_path / "no.yaml"))
    path = config({"port": 1})
    assert "--config given 2 times" in parse_error(
        capsys, "serve", "--config", path, "--config", path
    )


def test_abbreviated_config_flag_is_an_error_not_ignored(config, capsys):
    err = parse_error(capsys, "serve", "--conf", config({"port": 1}))
    assert "--config was not read: spell it in full, --config FILE" in err


def test_empty_file_sets_nothing(config):
    args = parse("serve", "--config", config(""))
    assert args.port == 8000


def test_config_for_other_subcommands(config):
    path = config({"prompt": "hi", "max-tokens": 5, "max-num-seqs": 3})
    args = parse("generate", "--config", path)  # the file gives the required --prompt
    assert (args.prompt, args.max_tokens, engine_args_from(args).max_num_seqs) == ("hi", 5, 3)
    path = config({"batch_size": 2, "block-size": 32})
    args = parse("bench", "latency", "--config", path)
    assert (args.batch_size, engine_args_from(args).block_size) == (2, 32)
    path = config({"prefill": ["http://p1", "http://p2"], "decode": "http://d", "port": 9})
    args = parse("proxy", "--config", path, "--decode", "http://d2")
    assert (args.prefill, args.decode, args.port) == (["http://p1", "http://p2"], ["http://d2"], 9)
    path = config({"request-rate": "inf", "percentile-metrics": "ttft,e2el"})
    args = parse("bench", "serve", "--config", path)
    assert args.request_rate == float("inf") and args.percentile_metrics == ("ttft", "e2el")
