"""The model's tokenizer for client-side tokenizers (issue 42, item 7): vLLM's
`/tokenizer_info` behind `--enable-tokenizer-info-endpoint` and the API key, and
`pagedllm export-tokenizer MODEL DIR`, whose directory `AutoTokenizer.from_pretrained` loads
into a tokenizer that encodes, decodes and renders chats exactly as the engine's."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from starlette.testclient import TestClient
from transformers import AutoTokenizer

from pagedllm.config import EngineArgs
from pagedllm.entrypoints.cli import build_parser, main
from pagedllm.entrypoints.openai.server_config import ServerConfig
from pagedllm.entrypoints.serve_cli import _template_and_tls_overrides
from pagedllm.entrypoints.tokenizer_files import export_tokenizer, tokenizer_info
from pagedllm.metrics.frontend.prometheus import PrometheusMetrics
from pagedllm.model.loader import load_tokenizer, resolve_model

TEXTS = [
    "Hello, world!",
    "  leading spaces and\ttabs\nand new lines\n\n",
    "Ünïcödé — 日本語のテキスト 🙂",
    "<|im_start|>user\nspecial tokens inside text<|im_end|>",
    "numbers 1234567890 and code: def f(x): return x**2",
    "",
]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
]


def assert_same_tokenizer(engine_tokenizer, exported) -> None:
    for text in TEXTS:
        for special in (True, False):
            ids = engine_tokenizer.encode(text, add_special_tokens=special)
            assert exported.encode(text, add_special_tokens=special) == ids, text
            for skip in (True, False):
                expected = engine_tokenizer.decode(ids, skip_special_tokens=skip)
                assert exported.decode(ids, skip_special_tokens=skip) == expected
    if engine_tokenizer.chat_template:
        for generation_prompt in (True, False):
            kwargs = dict(tokenize=False, add_generation_prompt=generation_prompt)
            expected = engine_tokenizer.apply_chat_template(MESSAGES, **kwargs)
            assert exported.apply_chat_template(MESSAGES, **kwargs) == expected
    assert exported.eos_token == engine_tokenizer.eos_token
    assert exported.bos_token == engine_tokenizer.bos_token
    assert len(exported) == len(engine_tokenizer)


def read_json(path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def test_export_of_the_default_gguf_model_loads_as_the_engines_tokenizer(tmp_path):
    export_tokenizer(None, str(tmp_path))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / name).is_file(), name
    engine_tokenizer = load_tokenizer(resolve_model(None))
    config = read_json(tmp_path / "tokenizer_config.json")
    assert config["chat_template"] == engine_tokenizer.chat_template
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"  # Transformers 4 knows it
    assert config["model_max_length"] == 8192  # the model's context, not "unset"
    special = read_json(tmp_path / "special_tokens_map.json")
    assert special["eos_token"]["content"] == engine_tokenizer.eos_token
    assert_same_tokenizer(engine_tokenizer, AutoTokenizer.from_pretrained(str(tmp_path)))


def test_export_of_a_tiny_model_by_the_command(tiny_llama, tmp_path, capsys):
    assert main(["export-tokenizer", str(tiny_llama), str(tmp_path / "out")]) == 0
    assert "written to" in capsys.readouterr().out
    exported = AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert_same_tokenizer(load_tokenizer(resolve_model(str(tiny_llama))), exported)


def test_export_with_a_chat_template_of_ones_own(tiny_llama, tmp_path):
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    out = tmp_path / "out"
    command = ["export-tokenizer", str(tiny_llama), str(out)]
    assert main([*command, "--chat-template", str(tmp_path / "t.jinja")]) == 0
    assert read_json(out / "tokenizer_config.json")["chat_template"] == template
    assert AutoTokenizer.from_pretrained(str(out)).chat_template == template


def _app(tiny_llama, **config):
    from pagedllm.core.engine_config import load_engine_config
    from pagedllm.entrypoints.openai.app import build_app
    from pagedllm.frontend.processor import InputProcessor

    _, tokenizer, engine_config = load_engine_config(
        EngineArgs(str(tiny_llama), max_model_len=64), log=False
    )
    engine = SimpleNamespace(
        config=engine_config,
        model_config=engine_config.model_config,
        tokenizer=tokenizer,
        input_processor=InputProcessor(engine_config, tokenizer),
    )
    metrics = PrometheusMetrics("m", 64)
    return build_app(engine, ServerConfig(("m",), **config), metrics), tokenizer


def test_tokenizer_info_is_off_by_default(tiny_llama):
    app, _ = _app(tiny_llama)
    assert TestClient(app).get("/tokenizer_info").status_code == 404


def test_tokenizer_info_in_vllms_shape_behind_the_api_key(tiny_llama):
    app, tokenizer = _app(tiny_llama, enable_tokenizer_info_endpoint=True, api_keys=("k",))
    client = TestClient(app)
    assert client.get("/tokenizer_info").status_code == 401
    response = client.get("/tokenizer_info", headers={"Authorization": "Bearer k"})
    assert response.status_code == 200
    info = response.json()
    assert info["tokenizer_class"] == type(tokenizer).__name__
    assert info["chat_template"] == tokenizer.chat_template
    assert info["eos_token"] == tokenizer.eos_token  # a token's text, as vLLM sends it
    assert info["model_max_length"] == tokenizer.model_max_length
    assert not {"vocab_file", "merges_file", "tokenizer_file"} & set(info)


def test_tokenizer_info_of_the_default_gguf_tokenizer():
    tokenizer = load_tokenizer(resolve_model(None))
    info = json.loads(json.dumps(tokenizer_info(tokenizer)))
    assert info["tokenizer_class"] == type(tokenizer).__name__
    assert info["bos_token"] == "<|im_start|>" and info["eos_token"] == "<|im_end|>"
    assert info["chat_template"] == tokenizer.chat_template
    assert info["added_tokens_decoder"]["0"] == "<|endoftext|>"


@pytest.mark.parametrize("flag", [[], ["--enable-tokenizer-info-endpoint"]])
def test_serve_takes_vllms_flag(flag):
    args = build_parser().parse_args(["serve", *flag])
    assert _template_and_tls_overrides(args)["enable_tokenizer_info_endpoint"] == bool(flag)
