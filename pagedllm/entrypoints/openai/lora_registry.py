"""The API process's LoRA adapters: model name -> `LoRARequest`, as requests name them.

Adapters come from `--lora-modules` (read and checked at start-up: a bad one stops the
server before it serves) and, with `--allow-runtime-lora-updating`, from
`POST /v1/load_lora_adapter` (checked in a worker thread, off the event loop). Every load
takes a new `lora_int_id`, never one used before: the id is the adapter's identity in the
engine (its resident weights, its prefix-cache entries), so a name unloaded and loaded again,
perhaps from another directory, can never run on the old weights. Loading touches only this
registry: the engine core reads an adapter when the first request that names it arrives, and
requests already running keep the adapter they started with even if it is unloaded.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.errors import InvalidRequestError
from pagedllm.lora.peft import LoRAAdapterError
from pagedllm.lora.request import LoRARequest
from pagedllm.value_checks import json_object

if TYPE_CHECKING:
    from pagedllm.frontend.async_llm import AsyncLLM

logger = logging.getLogger("pagedllm")

# Adapter names are model names: shown in /v1/models, responses and metric labels.
MAX_LORA_NAME_CHARS = 256
MAX_LORA_PATH_CHARS = 4096


@dataclass(frozen=True)
class LoRAModulePath:
    """One `--lora-modules` entry (vLLM's name): the adapter's name, its PEFT directory, and
    the model it was trained on (shown as the card's `parent` in /v1/models)."""

    name: str
    path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        check_lora_name(self.name, "lora_modules")
        check_lora_path(self.path, "lora_modules")
        if self.base_model_name is not None and (
            not isinstance(self.base_model_name, str) or not self.base_model_name
        ):
            raise ValueError("lora_modules: base_model_name must be a non-empty string")


def check_lora_name(name: object, param: str) -> str:
    """`name` if it can name an adapter; InvalidRequestError naming `param` otherwise."""
    if not isinstance(name, str) or not name.strip():
        raise InvalidRequestError(f"{param}: an adapter name must be a non-empty string", param)
    if len(name) > MAX_LORA_NAME_CHARS:
        raise InvalidRequestError(
            f"{param}: an adapter name is at most {MAX_LORA_NAME_CHARS} characters", param
        )
    if "," in name:  # lora_requests_info lists the running adapters' names joined by commas
        raise InvalidRequestError(f"{param}: an adapter name may not contain ','", param)
    return name


def check_lora_path(path: object, param: str) -> str:
    """`path` if it can be an adapter's directory; InvalidRequestError naming `param`."""
    if not isinstance(path, str) or not path:
        raise InvalidRequestError(f"{param}: an adapter path must be a non-empty string", param)
    if len(path) > MAX_LORA_PATH_CHARS:
        raise InvalidRequestError(
            f"{param}: an adapter path is at most {MAX_LORA_PATH_CHARS} characters", param
        )
    return path


def parse_lora_module(value: str) -> LoRAModulePath:
    """`name=path`, or JSON `{"name": ..., "path": ..., "base_model_name": ...}` (vLLM's two
    forms of a `--lora-modules` value); ValueError saying what is wrong."""
    if value.lstrip().startswith("{"):
        return _parse_json_module(value)
    name, sep, path = value.partition("=")
    if not sep:
        raise ValueError(
            f"lora_modules: expected name=path or a JSON object with name and path, got {value!r}"
        )
    return LoRAModulePath(name, path)


def _parse_json_module(value: str) -> LoRAModulePath:
    fields = json_object("lora_modules", value)
    unknown = sorted(set(fields) - {"name", "path", "base_model_name"})
    if unknown:
        raise ValueError(f"lora_modules: unknown key(s) {', '.join(unknown)} in {value!r}")
    missing = [key for key in ("name", "path") if key not in fields]
    if missing:
        raise ValueError(f"lora_modules: {' and '.join(missing)} missing in {value!r}")
    return LoRAModulePath(fields["name"], fields["path"], fields.get("base_model_name"))


def adapter_checker(engine: AsyncLLM) -> Callable[[LoRARequest], None]:
    """What a new adapter must pass before it is served: the engine's own reading of it
    (files, format, rank against max_lora_rank, shapes against this model), remembered so
    the first request that names it does not read it again on the event loop."""
    if engine.config.lora_config is None:
        raise ValueError("LoRA adapters need the engine started with enable_lora")
    return engine.input_processor.check_lora_adapter


class LoRARegistry:
    """The adapters requests may name, by name; `served_model_names` name the base model."""

    def __init__(
        self, served_model_names: tuple[str, ...], check: Callable[[LoRARequest], None]
    ) -> None:
        self.served_model_names = served_model_names
        self._check = check
        self._adapters: dict[str, LoRARequest] = {}
        self._loading: set[str] = set()  # names whose load is being checked
        self._ids = itertools.count(1)

    # ---- lookups ------------------------------------------------------------------------
    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter `model` names, or None for the base model; 404 for anything else."""
        if model is None or model in self.served_model_names:
            return None
        lora_request = self._adapters.get(model)
        if lora_request is None:
            raise OpenAIError(404, f"The model `{model}` does not exist.", "model")
        return lora_request

    def adapters(self) -> list[LoRARequest]:
        return list(self._adapters.values())

    # ---- changes ------------------------------------------------------------------------
    def add_static(self, modules: tuple[LoRAModulePath, ...]) -> None:
        """`--lora-modules`, read and checked now: a bad one raises ValueError (start-up
        fails with the reason)."""
        for module in modules:
            lora_request = self._new_request(module.name, module.path, module.base_model_name)
            try:
                self._check(lora_request)
            except LoRAAdapterError as error:
                raise ValueError(f"lora_modules: {error}") from None
            self._adapters[module.name] = lora_request
            logger.info("LoRA adapter %r served from %s", module.name, module.path)

    async def load(self, name: str, path: str) -> LoRARequest:
        """Check the adapter off the event loop, then serve it under `name`. 400 when the
        name is taken or the adapter cannot be served (the reason in the message)."""
        if name in self._adapters or name in self._loading:
            raise OpenAIError(
                400, f"The lora adapter '{name}' has already been loaded.", "lora_name"
            )
        lora_request = self._new_request(name, path, None)
        started = time.monotonic()
        self._loading.add(name)
        try:
            await asyncio.to_thread(self._check, lora_request)
        except LoRAAdapterError as error:
            raise OpenAIError(400, str(error), "lora_path") from None
        finally:
            self._loading.discard(name)
        self._adapters[name] = lora_request
        logger.info(
            "Loaded LoRA adapter %r (id %d) from %s in %.3f s",
            name,
            lora_request.lora_int_id,
            path,
            time.monotonic() - started,
        )
        return lora_request

    def unload(self, name: str, lora_int_id: int | None = None) -> LoRARequest:
        """Stop serving `name` (requests already running keep it); 404 when not loaded."""
        lora_request = self._adapters.get(name)
        if lora_request is None:
            raise OpenAIError(404, f"The lora adapter '{name}' cannot be found.", "lora_name")
        if lora_int_id is not None and lora_int_id != lora_request.lora_int_id:
            raise OpenAIError(
                404,
                f"The lora adapter '{name}' is loaded with id {lora_request.lora_int_id}, "
                f"not {lora_int_id}.",
                "lora_int_id",
            )
        del self._adapters[name]
        logger.info("Unloaded LoRA adapter %r (id %d)", name, lora_request.lora_int_id)
        return lora_request

    def _new_request(self, name: str, path: str, base_model_name: str | None) -> LoRARequest:
        check_lora_name(name, "lora_name")
        check_lora_path(path, "lora_path")
        if name in self.served_model_names:
            raise InvalidRequestError(
                f"lora_name: {name!r} is the base model's served name", "lora_name"
            )
        # Taken even if the check then fails: an id is never handed out twice.
        return LoRARequest(name, next(self._ids), path, base_model_name)
