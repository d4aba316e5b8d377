"""The API process's LoRA adapters: model name -> `LoRARequest`, as requests name them.

Adapters come from `--lora-modules` (read and checked at start-up: a bad one stops the
server before it serves) and, with `--allow-runtime-lora-updating`, from
`POST /v1/load_lora_adapter` (checked in a worker thread, off the event loop). Every load
takes a new `lora_int_id`, never one used before: the id is the adapter's identity in the
engine (its resident weights, its prefix-cache entries), so a name unloaded and loaded again,
perhaps from another directory, can never run on the old weights. Loading touches only this
registry: the engine core reads an adapter when the first request that names it arrives, and
requests already running keep the adapter they started with even if it is unloaded.

Who may load and unload is the server's business (an admin key, `app.py`); this registry
keeps the rest safe for whoever calls: a `--lora-modules` adapter is never unloaded nor
replaced (requests that name it get the operator's weights), and a runtime load reads only
under the path roots (`--lora-path-root`, by default the directories holding the
`--lora-modules` adapters), checked on the resolved path so `..` and symlinks cannot leave
them. Every failure to find or read an adapter there (outside the roots, missing, not a
directory, unreadable) is answered with one message, `UNLOADABLE_PATH`, so the answers cannot
tell which paths exist on the server; the log keeps the reason for the operator.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.errors import InvalidRequestError
from pagedllm.heap import trim_heap
from pagedllm.lora.peft import LoRAAdapterError, LoRAAdapterFileError
from pagedllm.lora.request import LoRARequest
from pagedllm.value_checks import json_object

if TYPE_CHECKING:
    from pagedllm.frontend.async_llm import AsyncLLM

logger = logging.getLogger("pagedllm")

# Adapter names are model names: shown in /v1/models, responses and metric labels.
MAX_LORA_NAME_CHARS = 256
MAX_LORA_PATH_CHARS = 4096
# The one answer to a runtime load whose path cannot be used, whatever the reason.
UNLOADABLE_PATH = (
    "lora_path: no LoRA adapter can be loaded from this path (it must be an adapter "
    "directory under the server's LoRA path root)"
)
NO_PATH_ROOT = (
    "lora_path: this server loads no adapters at runtime: start it with --lora-path-root "
    "(or --lora-modules, whose directories are then the roots)"
)


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


def resolved_root(path: str, param: str = "lora_path_root") -> str:
    """`path` as a root runtime loads may read under: its real path, a directory."""
    resolved = os.path.realpath(path)
    if not os.path.isdir(resolved):
        raise ValueError(f"{param}: {path!r} is not a directory")
    return resolved


def is_under(path: str, roots: tuple[str, ...]) -> bool:
    """Whether the real path `path` is one of `roots` (real paths) or inside one."""
    return any(os.path.commonpath((path, root)) == root for root in roots)


class LoRARegistry:
    """The adapters requests may name, by name; `served_model_names` name the base model.

    `path_roots`: the directories runtime loads may read under (each a real path); empty,
    the directories holding the `--lora-modules` adapters are (see `add_static`)."""

    def __init__(
        self,
        served_model_names: tuple[str, ...],
        check: Callable[[LoRARequest], None],
        path_roots: tuple[str, ...] = (),
    ) -> None:
        self.served_model_names = served_model_names
        self._check = check
        self._adapters: dict[str, LoRARequest] = {}
        self._static: set[str] = set()  # --lora-modules names: never unloaded or replaced
        self._roots = tuple(resolved_root(root) for root in path_roots)
        self._default_roots = not path_roots
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

    @property
    def path_roots(self) -> tuple[str, ...]:
        return self._roots

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
            self._static.add(module.name)
            if self._default_roots:
                parent = os.path.dirname(os.path.realpath(module.path))
                if parent not in self._roots:
                    self._roots += (parent,)
            logger.info("LoRA adapter %r served from %s", module.name, module.path)

    async def load(self, name: str, path: str) -> LoRARequest:
        """Check the adapter off the event loop, then serve it under `name`. 400 when the
        name is taken, when the path cannot be read (`UNLOADABLE_PATH`, whatever the cause)
        or the adapter there cannot be served (the reason in the message)."""
        self._check_name_free(name)
        check_lora_path(path, "lora_path")
        resolved = self._resolve(name, path)
        lora_request = self._new_request(name, resolved, None)
        started = time.monotonic()
        self._loading.add(name)
        try:
            await asyncio.to_thread(self._check_then_trim, lora_request)
        except LoRAAdapterFileError as error:
            logger.warning("Refused to load LoRA adapter %r: %s", name, error)
            raise OpenAIError(400, UNLOADABLE_PATH, "lora_path") from None
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
        if name in self._static:
            raise OpenAIError(
                400,
                f"The lora adapter '{name}' is served from --lora-modules and cannot be unloaded.",
                "lora_name",
            )
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

    def _check_then_trim(self, lora_request: LoRARequest) -> None:
        """The check, then the heap trimmed: reading the adapter's weights in a worker thread
        leaves their size free but resident in that thread's arena (`pagedllm.heap`), an API
        process that grows by tens of MB as loads land on new worker threads."""
        try:
            self._check(lora_request)
        finally:
            trim_heap()

    def _check_name_free(self, name: str) -> None:
        """400 naming `lora_name` unless a runtime load may take `name`."""
        self._check_name(name)
        if name in self._static:
            raise OpenAIError(
                400,
                f"The lora adapter '{name}' is served from --lora-modules and cannot be replaced.",
                "lora_name",
            )
        if name in self._adapters or name in self._loading:
            raise OpenAIError(
                400, f"The lora adapter '{name}' has already been loaded.", "lora_name"
            )

    def _resolve(self, name: str, path: str) -> str:
        """`path`'s real path if it lies under a root; `UNLOADABLE_PATH` (400) otherwise.
        The real path is what is read from then on: a link under a root that points out of
        it is refused, not followed."""
        if not self._roots:
            raise OpenAIError(400, NO_PATH_ROOT, "lora_path")
        try:
            resolved = os.path.realpath(path)
        except (OSError, ValueError):  # a NUL byte, a loop of links
            resolved = None
        if resolved is None or not is_under(resolved, self._roots):
            logger.warning("Refused to load LoRA adapter %r: %r is outside the roots", name, path)
            raise OpenAIError(400, UNLOADABLE_PATH, "lora_path")
        return resolved

    def _check_name(self, name: str) -> None:
        check_lora_name(name, "lora_name")
        if name in self.served_model_names:
            raise InvalidRequestError(
                f"lora_name: {name!r} is the base model's served name", "lora_name"
            )

    def _new_request(self, name: str, path: str, base_model_name: str | None) -> LoRARequest:
        self._check_name(name)
        check_lora_path(path, "lora_path")
        # Taken even if the check then fails: an id is never handed out twice.
        return LoRARequest(name, next(self._ids), path, base_model_name)
