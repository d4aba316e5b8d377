"""A served model's tokenizer as clients read it: vLLM's `/tokenizer_info` fields
(`tokenizer_info`) and a Hugging Face tokenizer directory (`export_tokenizer`, the
`pagedllm export-tokenizer MODEL DIR` command).

Client-side tokenizers (lm-eval's `local-completions`, a chat UI counting tokens) load a
tokenizer with `AutoTokenizer.from_pretrained`. A GGUF model has none on disk: its
vocabulary is inside the file, and the engine converts it (`model/gguf/tokenizer.py`). The
exported directory is that converted tokenizer, written so that Transformers 4 and 5 both
load it: the chat template inside `tokenizer_config.json` as well as in
`chat_template.jinja` (Transformers 5 writes only the latter, 4 reads only the former), a
`special_tokens_map.json` (which 5 no longer writes), and the class named
`PreTrainedTokenizerFast` (5's `TokenizersBackend` is the same class under a name 4 lacks).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from pagedllm.frontend.chat_template import load_chat_template
from pagedllm.model.loader import load_hf_config, load_tokenizer, resolve_model

# File paths on the server's disk: meaningless to a client (vLLM drops the first two).
_PATH_FIELDS = ("vocab_file", "merges_file", "tokenizer_file")
# Transformers' "no limit set" model_max_length (int(1e30)).
_UNSET_MAX_LENGTH = int(1e30)
_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def json_ready(value: Any) -> Any:
    """`value` with tokens (`AddedToken`) as their text and dict keys as strings, so that
    `json.dumps` takes it, as vLLM's `TokenizerInfo` serializes them."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {str(key): json_ready(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [json_ready(item) for item in value]
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)


def tokenizer_info(tokenizer: Any) -> dict[str, Any]:
    """vLLM's `/tokenizer_info` body: the tokenizer's configuration (its `init_kwargs`, as
    `tokenizer_config.json` holds them) without file paths, with `tokenizer_class` and the
    chat template the server renders."""
    info = {
        key: json_ready(value)
        for key, value in (getattr(tokenizer, "init_kwargs", None) or {}).items()
        if key not in _PATH_FIELDS
    }
    info["tokenizer_class"] = type(tokenizer).__name__
    chat_template = getattr(tokenizer, "chat_template", None)
    if chat_template:
        info["chat_template"] = chat_template
    return info


def export_tokenizer(model: str | None, directory: str, chat_template: str | None = None) -> str:
    """Write the tokenizer pagedllm loads for `model` (None: the default model) as a Hugging
    Face tokenizer directory; `chat_template` replaces the model's. Returns the directory."""
    source = resolve_model(model)
    tokenizer = load_tokenizer(source)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    os.makedirs(directory, exist_ok=True)
    tokenizer.save_pretrained(directory)
    context = getattr(load_hf_config(source), "max_position_embeddings", None)
    _complete_config(tokenizer, directory, context)
    _write_special_tokens_map(tokenizer, directory)
    return directory


def _complete_config(tokenizer: Any, directory: str, context: int | None) -> None:
    """What `save_pretrained` leaves out of `tokenizer_config.json` that older readers need."""
    path = os.path.join(directory, "tokenizer_config.json")
    with open(path, encoding="utf-8") as file:
        config = json.load(file)
    if getattr(tokenizer, "chat_template", None):
        config["chat_template"] = tokenizer.chat_template
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    # A GGUF tokenizer knows no length: the model's context is the one clients need.
    if context and config.get("model_max_length", _UNSET_MAX_LENGTH) >= _UNSET_MAX_LENGTH:
        config["model_max_length"] = context
    for key in ("is_local", "local_files_only"):  # how this process loaded it, not config
        config.pop(key, None)
    _write_json(path, config)


def _write_special_tokens_map(tokenizer: Any, directory: str) -> None:
    init = getattr(tokenizer, "init_kwargs", None) or {}
    tokens = {}
    for name in _SPECIAL_TOKENS:
        token = init.get(name) or getattr(tokenizer, name, None)
        if token is None:
            continue
        tokens[name] = _token_entry(token)
    _write_json(os.path.join(directory, "special_tokens_map.json"), tokens)


def _token_entry(token: Any) -> Any:
    """An `AddedToken` as Transformers writes it (its flags kept), a plain string as is."""
    if not hasattr(token, "content"):
        return str(token)
    return {
        flag: getattr(token, flag)
        for flag in ("content", "lstrip", "normalized", "rstrip", "single_word")
        if hasattr(token, flag)
    }


def _write_json(path: str, value: Any) -> None:
    with open(path, "w", encoding="utf-8") as file:
        json.dump(value, file, indent=2, ensure_ascii=False)
        file.write("\n")


def add_export_tokenizer_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "export-tokenizer",
        help="write a model's tokenizer (a GGUF's included) as a Hugging Face tokenizer "
        "directory for client-side tokenizers (lm-eval, AutoTokenizer.from_pretrained)",
    )
    parser.add_argument(
        "model",
        help='the model as `serve` takes it: a directory or a .gguf file ("" for the '
        "default model)",
    )
    parser.add_argument("directory", help="where to write tokenizer.json and its config")
    parser.add_argument(
        "--chat-template",
        default=None,
        metavar="TEMPLATE",
        help="a chat template to write in place of the model's: a file holding a Jinja "
        "template, or the template (default: the model's own)",
    )
    parser.set_defaults(handler=run_export_tokenizer)


def run_export_tokenizer(args: argparse.Namespace) -> int:
    template = None if args.chat_template is None else load_chat_template(args.chat_template)
    directory = export_tokenizer(args.model or None, args.directory, template)
    print(f"tokenizer of {resolve_model(args.model or None).path} written to {directory}")
    return 0
