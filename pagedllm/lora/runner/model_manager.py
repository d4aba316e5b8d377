"""`LoRAModelManager`: the model runner's adapters: loaded ones, resident ones, the step's.

Adapters are read from disk when the first request that names one arrives, and kept in
memory (`max_cpu_loras`, least recently used dropped beyond it, never one a live request
uses). Each step names at most `max_loras` adapters (the scheduler sees to it); each gets a
slot in every `LoRALinear`, an adapter already resident keeps its own, and a new one takes
a free slot or the one least recently used. The step's layout then goes to every layer
through their shared `LoRAState`.

Every rank runs its own manager on the same scheduler outputs, so each reads the adapters a
step names and gives them the same slots: pipeline stages load their own layers' modules,
tensor-parallel ranks their cut of each (`lora/model/layers.py`, `RankCut`).
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from pagedllm.config import ModelConfig
from pagedllm.distributed.parallel_state import get_tp_group
from pagedllm.lora.config import LoRAConfig
from pagedllm.lora.model.layers import LoRAState, LoRAStep, lora_target, wrap_lora_modules
from pagedllm.lora.peft import LoRAAdapter, LoRAAdapterError, projection_shapes, read_adapter
from pagedllm.lora.request import LoRARequest
from pagedllm.model.pipeline import PPMissingLayer

logger = logging.getLogger(__name__)

NO_SLOT = -1


class LoRAModelManager:
    def __init__(
        self,
        model: nn.Module,
        config: LoRAConfig,
        model_config: ModelConfig,
        device: torch.device,
    ) -> None:
        self.config = config
        self.state = LoRAState()
        self.layers = wrap_lora_modules(
            model,
            config.max_loras,
            config.max_lora_rank,
            self.state,
            model_config.dtype,
            device,
            get_tp_group().world_size,
        )
        # Pipeline parallel: decoder layers another stage runs (it applies their deltas).
        self._other_stages = {
            f"{name}."
            for name, module in model.named_modules()
            if isinstance(module, PPMissingLayer)
        }
        self.shapes = projection_shapes(model_config)
        self.device = device
        self.adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()  # least recent first
        self.slots: list[int | None] = [None] * config.max_loras  # slot -> adapter id
        self._slot_used_at = [0] * config.max_loras
        self._num_steps = 0
        self.request_loras: dict[str, int] = {}  # request id -> adapter id
        logger.info(
            "LoRA: %d layers, %d slots of %.1f MiB (rank <= %d), up to %d adapters loaded",
            len(self.layers),
            config.max_loras,
            self.slot_bytes / 2**20,
            config.max_lora_rank,
            config.max_cpu_loras,
        )

    # ---- adapters and requests ------------------------------------------------------
    def add_request(self, request_id: str, lora_request: LoRARequest) -> None:
        """The request runs with `lora_request`; its adapter is read now if not loaded
        (a `LoRAAdapterError` fails this request alone)."""
        self.add_adapter(lora_request)
        self.request_loras[request_id] = lora_request.lora_int_id

    def remove_request(self, request_id: str) -> None:
        self.request_loras.pop(request_id, None)

    def add_adapter(self, lora_request: LoRARequest) -> LoRAAdapter:
        lora_id = lora_request.lora_int_id
        adapter = self.adapters.get(lora_id)
        if adapter is not None and adapter.request.lora_path == lora_request.lora_path:
            self.adapters.move_to_end(lora_id)
            return adapter
        adapter = read_adapter(lora_request, self.shapes, self.config.max_lora_rank)
        for module in adapter.modules:
            target = lora_target(module)[0]
            if target not in self.layers and not self._on_other_stage(target):
                raise LoRAAdapterError(
                    f"LoRA adapter {lora_request.lora_name!r}: module {module!r} has no LoRA "
                    "layer in this model"
                )
        self._drop_slot(lora_id)  # the id's weights changed: its slot is stale
        self.adapters[lora_id] = adapter
        self._evict_unused(lora_id)
        return adapter

    def _evict_unused(self, added: int) -> None:
        """Drop the least recently used adapters past `max_cpu_loras` that no request runs;
        `added`, just read for a request not yet recorded, is kept."""
        in_use = {*self.request_loras.values(), added}
        for lora_id in list(self.adapters):
            if len(self.adapters) <= self.config.max_cpu_loras:
                return
            if lora_id not in in_use:
                del self.adapters[lora_id]

    def _drop_slot(self, lora_id: int) -> None:
        if lora_id in self.slots:
            self.slots[self.slots.index(lora_id)] = None

    # ---- one step -------------------------------------------------------------------
    def set_step(self, request_ids: list[str], num_scheduled: np.ndarray) -> bool:
        """Lay out the step's adapter tokens (requests in batch order, tokens each) for
        every LoRA layer; returns whether any token runs an adapter."""
        self._num_steps += 1
        lora_ids = [self.request_loras.get(r, 0) for r in request_ids]
        if not any(lora_ids):
            self.state.step = None
            return False
        step_ids = set(lora_ids)
        slot_of = {lora_id: self._slot_for(lora_id, step_ids) for lora_id in step_ids}
        slot_of[0] = NO_SLOT
        request_slots = np.array([slot_of[i] for i in lora_ids], dtype=np.int64)
        token_slots = np.repeat(request_slots, num_scheduled)
        self.state.step = LoRAStep.build(token_slots, self.config.max_loras, self.device)
        return self.state.step is not None

    def _slot_for(self, lora_id: int, step_ids: set[int]) -> int:
        if lora_id == 0:
            return NO_SLOT
        if lora_id in self.slots:
            slot = self.slots.index(lora_id)
        else:
            free = [s for s, held in enumerate(self.slots) if held is None or held not in step_ids]
            if not free:
                raise RuntimeError(
                    f"a step names more than max_loras={self.config.max_loras} adapters"
                )
            slot = min(free, key=lambda s: (self.slots[s] is not None, self._slot_used_at[s]))
            self._load_slot(slot, self.adapters[lora_id])
            self.slots[slot] = lora_id
        self._slot_used_at[slot] = self._num_steps
        self.adapters.move_to_end(lora_id)
        return slot

    def _load_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        for layer in self.layers.values():
            layer.clear_slot(slot)
        for module, weights in adapter.modules.items():
            name, shard = lora_target(module)
            if name in self.layers:  # else a layer of another pipeline stage
                self.layers[name].set_slice(slot, shard, weights.lora_a, weights.lora_b)

    def _on_other_stage(self, target: str) -> bool:
        return any(target.startswith(prefix) for prefix in self._other_stages)

    @property
    def slot_bytes(self) -> int:
        """Memory one resident adapter's slot takes across the model's LoRA layers."""
        return sum(
            (layer.lora_a[0].nbytes + layer.lora_b[0].nbytes) for layer in self.layers.values()
        )
