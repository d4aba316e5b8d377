"""The compiled decode step (`EngineArgs.compile`, on by default where it is exact:
`compile_choice.py`): decode-only steps run the model's forward through torch.compile
(Inductor), the CPU counterpart of CUDA-graph capture.

Between its kernels, an eager decode step of a few sequences runs Python: module calls,
dispatch, the fast paths' checks, about 1 ms of a 16 ms step at batch 1 on the default
model. Compiled, the step is one graph that calls the same kernels (their fake versions let
the tracer through, `ops/extension.py`) with nothing in between, so its output is the eager
forward's, bit for bit. Transcendental element-wise work is a kernel too (Gemma's GELU and
logit soft-cap: `fused.gelu_tanh_and_mul`, `fused.soft_cap`), because a graph's own tanh
differs from ATen's in the last bits.

One graph serves every decode step of 1..max_batch_size requests: sizes are symbolic, none
is specialized (not even 1), and equal sizes are not merged. max_batch_size is 96 (the
skinny kernel's range), or one less than `fused.PACKED_MIN_ROWS` (3 on a CPU with AVX-512,
23 without) where the linear layers hold oneDNN-packed weights, which serve more rows
faster eagerly than the graph's skinny kernel does. It is compiled at start-up on a dummy
decode that writes only the reserved null block, so no request waits for the compiler.
The graph does not guard on the model's modules (checking them cost 2 ms a step): its
structure is fixed by then, and each model's step has a code object of its own, so no
other model of its class reaches its graph. Inductor keeps its compiled code under
pagedllm's cache directory; tracing is redone at each start (the default model: 62 s the
first time, 13 s from the cache). Floats are specialized up front: left symbolic, they
made Dynamo trace the whole model twice (its analysis restarts to specialize them
anyway), 58 s a start instead of 13.
Prefill steps and larger batches stay eager: their matmuls dwarf the Python around them.
"""

from __future__ import annotations

import logging
import os
import time
import types
from collections.abc import Callable

import numpy as np
import torch

from pagedllm.ops import fused
from pagedllm.ops.attention import AttentionBackend, AttentionLayout, AttentionMetadata
from pagedllm.utils import cache_root

logger = logging.getLogger(__name__)


def _use_pagedllm_cache() -> None:
    """Inductor's compiled code under pagedllm's cache directory, unless the user named one.
    Importing torch._dynamo (any library's `torch.compiler.disable` does) writes torch's own
    default into TORCHINDUCTOR_CACHE_DIR, so that value counts as unset: a plain setdefault
    never took, and the code went to /tmp/torchinductor_<user>, which a reboot or a tmp
    cleaner empties (the next start then compiles from nothing: about a minute)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen is None or os.path.abspath(chosen) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_root() / "inductor")


# Decode steps of up to this many requests can run compiled. Python's share of a step falls
# as the batch grows (2% at 256); larger batches would also take the other side of the
# linear layers' branch on the row count, a second graph for no gain.
MAX_BATCH_SIZE = fused.SKINNY_MAX_ROWS


def compiled_batch_limit(model: torch.nn.Module) -> int:
    """The largest decode step worth compiling for `model`: MAX_BATCH_SIZE, or one less than
    `fused.PACKED_MIN_ROWS` where its linear layers hold oneDNN-packed weights, which serve
    that many rows and more faster eagerly than the graph's skinny kernel does."""
    packed = any(getattr(m, "packed_weight", None) is not None for m in model.modules())
    return fused.PACKED_MIN_ROWS - 1 if packed else MAX_BATCH_SIZE


class CompiledDecode:
    """The model's forward compiled for decode-only steps (one token per request)."""

    def __init__(
        self, model: torch.nn.Module, max_batch_size: int = MAX_BATCH_SIZE, num_kv_groups: int = 1
    ) -> None:
        """`max_batch_size`: the largest decode step to run compiled (at most
        MAX_BATCH_SIZE); the model runner lowers it where oneDNN's packed weights serve
        larger batches faster than the compiled graph's skinny kernel. `num_kv_groups`:
        the model's KV cache groups (a step's metadata is then a tuple, one per group)."""
        self.max_batch_size = min(max_batch_size, MAX_BATCH_SIZE)
        self.num_kv_groups = num_kv_groups
        _use_pagedllm_cache()
        # Sizes that happen to be equal while tracing (a batch of 2 and a 2-column block
        # table) must not become one symbol, or the next step recompiles.
        torch.fx.experimental._config.use_duck_shape = False
        # Nor may a size of 1 be specialized: one graph then serves every batch size.
        torch.fx.experimental._config.backed_size_oblivious = True
        # Floats are constants of the model (eps, scales, the soft-cap), never inputs.
        torch._dynamo.config.specialize_float = True
        self._attention_backend: AttentionBackend = model.attention_backend
        # No guards on the modules: Dynamo checked every module and parameter of the model
        # before each step (2.2 ms of a 31 ms Gemma 3 270M step; 0.3 ms without). The
        # model's structure is fixed before it is compiled (LoRA wrappers, taps, packed and
        # quantized layers are all in place by then), and parameters are read afresh each
        # step, so weights written or replaced later are still the ones used. Without those
        # guards nothing tells two models of one class apart, and Dynamo keeps its graphs
        # per code object: each compiled step traces through a code object of its own.
        self._forward: Callable[..., torch.Tensor] = torch.compile(
            _own_entry(model),
            dynamic=True,
            fullgraph=True,
            options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe},
        )

    def applies(self, num_scheduled_tokens: np.ndarray) -> bool:
        """A decode-only step of at most `max_batch_size` requests."""
        return len(num_scheduled_tokens) <= self.max_batch_size and bool(
            (num_scheduled_tokens == 1).all()
        )

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata | tuple[AttentionMetadata, ...],
    ) -> torch.Tensor:
        return self._forward(input_ids, positions, metadata)

    def warm_up(self, device: torch.device) -> float:
        """Compile now, on a dummy decode of two requests; returns the seconds it took."""
        logger.info(
            "Compiling the decode step: a minute or more on a first start, 15-20 s from "
            "Inductor's cache after (--enforce-eager skips it)"
        )
        started = time.perf_counter()
        self(*_dummy_decode(2, device, self._attention_backend, self.num_kv_groups))
        elapsed = time.perf_counter() - started
        logger.info(
            "Compiled the decode step (batches of 1 to %d) in %.1f s", self.max_batch_size, elapsed
        )
        return elapsed


def _own_entry(model: torch.nn.Module) -> Callable[..., torch.Tensor]:
    """`model.forward(input_ids, positions, metadata)` through a code object no other
    function shares, so the graphs Dynamo keeps on it serve this model alone."""

    def decode_step(input_ids, positions, metadata):
        return model.forward(input_ids, positions, metadata)

    code = decode_step.__code__.replace()  # a copy: equal, but another object
    return types.FunctionType(code, decode_step.__globals__, None, None, decode_step.__closure__)


def _dummy_decode(
    batch_size: int, device: torch.device, backend: AttentionBackend, num_kv_groups: int = 1
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata | tuple[AttentionMetadata, ...]]:
    """Requests of one token at position 0 in the null block (block 0, never handed out)."""

    def zeros() -> torch.Tensor:  # a new tensor each: the graph guards on aliasing
        return torch.zeros(batch_size, dtype=torch.int64, device=device)

    layout = AttentionLayout(
        slot_mapping=np.zeros(batch_size, dtype=np.int64),
        block_tables=np.zeros((batch_size, 1), dtype=np.int64),
        query_start_loc=np.arange(batch_size + 1, dtype=np.int64),
        seq_lens=np.ones(batch_size, dtype=np.int64),
    )
    if num_kv_groups == 1:
        return zeros(), zeros(), backend.build_metadata(layout, device)
    metadata = tuple(backend.build_metadata(layout, device) for _ in range(num_kv_groups))
    return zeros(), zeros(), metadata
