"""Engine arguments as command-line flags: one `--flag-name` per `EngineArgs` field."""

from __future__ import annotations

import argparse
import dataclasses

from pagedllm.config import EngineArgs


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One `--flag-name` per EngineArgs field (vLLM's names), typed from the field's default."""
    group = parser.add_argument_group("engine")
    for field in dataclasses.fields(EngineArgs):
        if field.name == "model":
            continue
        flag = "--" + field.name.replace("_", "-")
        if field.type in ("bool", bool):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default)
        elif field.type in ("int", int) or field.name in ("max_model_len",):
            group.add_argument(flag, type=int, default=field.default)
        else:
            group.add_argument(flag, default=field.default)
    group.add_argument(
        "--model",
        default=None,
        help="Hugging Face directory or .gguf file (default: SmolLM2-135M-Instruct)",
    )


def engine_args_from(namespace: argparse.Namespace) -> EngineArgs:
    values = {f.name: getattr(namespace, f.name) for f in dataclasses.fields(EngineArgs)}
    return EngineArgs(**values)


def llm_from_args(namespace: argparse.Namespace, model: str | None = None):
    """The `LLM` the engine flags describe; `model` overrides `--model` when given."""
    from pagedllm import LLM

    engine_args = engine_args_from(namespace)
    if model is not None:
        engine_args.model = model
    return LLM(**dataclasses.asdict(engine_args))
