"""Engine configuration: frozen, validated dataclasses and the `EngineArgs` that build them.

`EngineArgs` is the flat, user-facing bag of options (keyword arguments of `LLM`, flags of
the CLI); `EngineArgs.create_engine_config()` resolves it against the model into the
frozen configs each component reads.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from pagedllm.kv_transfer.config import PREEMPTION_MODES, KVTierConfig, KVTransferConfig
from pagedllm.lora.config import LoRAConfig
from pagedllm.parallel_config import (
    EXECUTOR_BACKENDS,  # noqa: F401 - re-exported: the flags and tests read it here
    ParallelConfig,
    default_executor_backend,
)
from pagedllm.pooling_params import RUNNERS, PoolerConfig
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.value_checks import check_known_keys

_MEMORY_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "t": 1000**4,
    "tb": 1000**4,
}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_memory_size(value: int | str, name: str = "kv_cache_memory") -> int:
    """Bytes from an int or a string such as ``"4GiB"``, ``"512MiB"``, ``"2G"`` or ``"1000000"``."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _MEMORY_UNITS:
        raise ValueError(f"{name}: cannot parse {value!r}; use e.g. 4GiB, 512MiB, 2G")
    return parse_memory_size(int(float(match.group(1)) * _MEMORY_UNITS[unit]), name)


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype in _DTYPES.values():
            return dtype
        raise ValueError(f"dtype: {dtype} is not supported; choose one of {sorted(_DTYPES)}")
    if dtype == "auto":
        return torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not supported; choose one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


@dataclass(frozen=True)
class ModelConfig:
    """What the engine needs to know about the model: resolved path, HF config, dtype, lengths."""

    model: str
    hf_config: Any
    dtype: torch.dtype
    max_model_len: int
    eos_token_ids: frozenset[int]
    seed: int = 0
    max_logprobs: int = 20
    quantization: str | None = None
    # "auto": the checkpoint's weights; "dummy": seeded random ones of the config's shapes.
    load_format: str = "auto"
    # quantization="gguf": bits an activation is quantized to (16: two int8 digits; 8: one).
    gguf_activation_bits: int = 16

    def __post_init__(self) -> None:
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")

    @property
    def architecture(self) -> str:
        return (getattr(self.hf_config, "architectures", None) or ["?"])[0]

    @property
    def num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        return getattr(self.hf_config, "num_key_value_heads", None) or (
            self.hf_config.num_attention_heads
        )

    @property
    def head_dim(self) -> int:
        head_dim = getattr(self.hf_config, "head_dim", None)
        return head_dim or self.hf_config.hidden_size // self.hf_config.num_attention_heads

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size


# "auto" stores K/V in the model's dtype; a 16-bit cache halves the memory (twice the
# tokens in the same kv_cache_memory) and the bytes attention reads per step. The 8-bit
# ones (int8, fp8 = fp8_e4m3 as in vLLM, fp8_e5m2) store each token's head vector scaled
# by its own fp32 absmax scale, kept beside K and V (`ops/kv_quant.py`): ~4x fp32's tokens.
KV_CACHE_DTYPES = {
    "auto": None,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one block table: the same attention kind (full, or one window)."""

    layers: tuple[int, ...]
    sliding_window: int | None = None


@dataclass(frozen=True)
class KVCacheGroups:
    """How a model's layers map onto the paged pool (vLLM's hybrid allocator).

    Layers with a sliding window and full layers keep separate block tables (groups), so a
    windowed group can free the blocks its window has passed. Groups are at most
    `layers_per_group` layers; the pool holds `layers_per_group` (K, V) tensor pairs, and
    a block id names one block in each pair: the group that holds the block uses them for
    its layers, in order. A request therefore takes one block per group per
    `block_size` tokens, less what its windowed groups have freed.
    """

    groups: tuple[KVCacheGroup, ...]

    def __post_init__(self) -> None:
        if not self.groups or any(not g.layers for g in self.groups):
            raise ValueError("KV cache groups must be non-empty")

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def layers_per_group(self) -> int:
        return max(len(group.layers) for group in self.groups)

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(group.sliding_window for group in self.groups)

    @property
    def has_windows(self) -> bool:
        return any(window is not None for window in self.windows)

    def layer_slots(self, layers: range | None = None) -> dict[int, tuple[int, int]]:
        """layer -> (its group, its tensor pair in the pool), for `layers` (a pipeline
        stage's; default all): a group's layers of the stage take pairs 0, 1, ... in order."""
        slots = {}
        for g, group in enumerate(self.groups):
            stage = [layer for layer in group.layers if layers is None or layer in layers]
            slots.update({layer: (g, slot) for slot, layer in enumerate(stage)})
        return dict(sorted(slots.items()))

    def num_tensor_pairs(self, layers: range | None = None) -> int:
        """(K, V) tensor pairs the pool needs for `layers` (default all)."""
        return max((slot + 1 for _, slot in self.layer_slots(layers).values()), default=0)

    def max_blocks_per_request(self, num_tokens: int, block_size: int) -> int:
        """Blocks one request of `num_tokens` tokens holds at most: every block for a full
        group, its window's blocks (and the one being filled) for a windowed group."""
        full = -(-num_tokens // block_size)
        return sum(
            full if w is None else min(full, -(-(w - 1) // block_size) + 1) for w in self.windows
        )


def kv_cache_groups(layer_windows: list[int | None]) -> KVCacheGroups:
    """Group layers by attention kind, `min(count per kind)` layers a group (vLLM's rule:
    Gemma 3's 15 local and 3 global layers make five local groups and one global group of
    three layers), so the pool's tensor pairs are shared without waste."""
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        kinds.setdefault(window, []).append(layer)
    size = min(len(layers) for layers in kinds.values())
    groups = [
        KVCacheGroup(tuple(layers[i : i + size]), window)
        for window, layers in kinds.items()
        for i in range(0, len(layers), size)
    ]
    # Full-attention groups first: group 0 is then the one every model has, if any.
    groups.sort(key=lambda g: (g.sliding_window is not None, g.layers[0]))
    return KVCacheGroups(tuple(groups))


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache geometry. `num_blocks` includes the reserved null block (id 0)."""

    block_size: int
    num_blocks: int
    kv_cache_memory: int
    enable_prefix_caching: bool = True
    cache_dtype: torch.dtype = torch.float32
    # None: one full-attention group of every layer.
    kv_groups: KVCacheGroups | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks < 2:
            raise ValueError(
                f"kv_cache_memory={self.kv_cache_memory} bytes holds {self.num_blocks} blocks; "
                "at least 2 (one is the reserved null block) are needed"
            )


# Scheduling policies (`core/request_queue.py` has one waiting queue per name): "fcfs"
# (arrival), "priority" (lowest value first), "fair" (weighted fair share between tenants).
SCHEDULING_POLICIES = ("fcfs", "priority", "fair")


def check_scheduling_policy(policy: object) -> None:
    if policy not in SCHEDULING_POLICIES:
        choices = ", ".join(repr(name) for name in SCHEDULING_POLICIES)
        raise ValueError(f"scheduling_policy must be one of {choices}, got {policy!r}")


def parse_tenant_weights(value: str | dict[str, float] | None) -> dict[str, float]:
    """Tenant weights for the "fair" policy from a dict or "name=weight,name=weight" (the
    CLI's form); a tenant not named weighs 1. ValueError naming the bad entry."""
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        pairs: list[tuple[str, object]] = []
        for item in value.split(","):
            name, sep, weight = item.partition("=")
            if not sep:
                raise ValueError(f"tenant_weights: expected name=weight, got {item.strip()!r}")
            try:
                pairs.append((name.strip(), float(weight)))
            except ValueError:
                raise ValueError(
                    f"tenant_weights: weight of {name.strip()!r} is not a number: {weight!r}"
                ) from None
    elif isinstance(value, dict):
        pairs = list(value.items())
    else:
        raise ValueError(f"tenant_weights must be a dict or a string, got {type(value).__name__}")
    weights: dict[str, float] = {}
    for name, weight in pairs:
        if not isinstance(name, str) or not name:
            raise ValueError(f"tenant_weights: tenant names are non-empty strings, got {name!r}")
        if (
            isinstance(weight, bool)
            or not isinstance(weight, int | float)
            or not math.isfinite(weight)
            or weight <= 0
        ):
            raise ValueError(
                f"tenant_weights: weight of {name!r} must be a finite number > 0, got {weight!r}"
            )
        weights[name] = float(weight)
    return weights


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits: the token budget and the number of running requests.

    Under the "fair" policy, `tenant_weights` (name -> weight, others weigh 1; held as sorted
    pairs so the config stays hashable) set each tenant's share, and `fair_quantum` is the
    tokens a weight-1 tenant is credited per deficit-round-robin turn (default: an eighth of
    the step's budget).
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 2048
    policy: str = "fcfs"
    # Given as a dict or "name=weight,..." too; kept as sorted (name, weight) pairs.
    tenant_weights: tuple[tuple[str, float], ...] | dict[str, float] | str = ()
    fair_quantum: int | None = None
    # Several ranks run the model (tensor or pipeline parallel): each scheduled running
    # request carries the token ids it runs (`CachedRequestData.token_ids`) for the ranks
    # that do not sample. Set by the engine core from its parallel config.
    send_token_ids: bool = False
    # Batches the engine core keeps in flight (pipeline parallel: one per stage, so stages
    # overlap). Above 1 the scheduler never schedules a request whose batch is still in
    # flight, and never preempts one. Set by the engine core.
    max_batches_in_flight: int = 1
    # LoRA: the most adapters one step may run (None: LoRA is off). Set from LoRAConfig.
    max_loras: int | None = None

    def __post_init__(self) -> None:
        check_scheduling_policy(self.policy)
        weights = self.tenant_weights
        if not isinstance(weights, tuple):
            weights = tuple(sorted(parse_tenant_weights(weights).items()))
            object.__setattr__(self, "tenant_weights", weights)
        if self.fair_quantum is None:
            object.__setattr__(self, "fair_quantum", max(1, self.max_num_batched_tokens // 8))
        elif not isinstance(self.fair_quantum, int) or self.fair_quantum < 1:
            raise ValueError(f"fair_quantum must be a positive integer, got {self.fair_quantum!r}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")


# Methods of checkpoints stored quantized: named by the checkpoint's quantization_config,
# which `--quantization` may repeat (model/quantization/registry.py decides what is served).
CHECKPOINT_QUANTIZATION_METHODS = ("gptq", "awq", "compressed-tensors", "fp8")
QUANTIZATION_METHODS = ("int8", "gguf", *CHECKPOINT_QUANTIZATION_METHODS)
# Where weights come from (EngineArgs.load_format; `model/loader.py` reads them).
LOAD_FORMATS = ("auto", "dummy")
# int8 runs on PyTorch's fbgemm kernels (x86 CPUs).
INT8_ENGINE = "fbgemm"


# quantization="gguf": activation bits per value, as two int8 digits (16) or one (8).
GGUF_ACTIVATION_BITS = (16, 8)


def verify_quantization(method: str | None) -> None:
    """Raise a ValueError naming the choices unless `method` is None or a known method."""
    if method is None:
        return
    if method not in QUANTIZATION_METHODS:
        choices = ", ".join(repr(m) for m in (None, *QUANTIZATION_METHODS))
        raise ValueError(f"quantization {method!r} is not supported; choose one of {choices}")
    if method == "int8" and INT8_ENGINE not in torch.backends.quantized.supported_engines:
        raise ValueError(
            f"quantization={method!r} needs PyTorch's {INT8_ENGINE} kernels (x86 CPUs); this "
            f"build has {torch.backends.quantized.supported_engines}"
        )


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    attention_backend: str = "cpu"
    device: str = "cpu"
    # Decode-only steps run a torch.compile'd forward (EngineArgs.compile): True, False, or
    # None where the engine decides (runner/compile_choice.py).
    compile: bool | None = None
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    speculative_config: SpeculativeConfig | None = None
    # method "draft_model" / "self_quantized": the model that proposes (None otherwise).
    draft_model_config: ModelConfig | None = None
    # LoRA adapters (enable_lora); None: off.
    lora_config: LoRAConfig | None = None
    # KV tiers (host memory, disk, swap, prefill/decode transfer); None: off.
    kv_tier_config: KVTierConfig | None = None
    # runner="pooling": how prompts become embeddings; None: the generate runner.
    pooler_config: PoolerConfig | None = None

    @property
    def distributed_executor_backend(self) -> str:
        return self.parallel_config.distributed_executor_backend


@dataclass
class EngineArgs:
    """User-facing engine options; names follow vLLM's (`--max-num-seqs` ⇄ `max_num_seqs`)."""

    model: str | None = None
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False
    dtype: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory: int | str | None = None
    # vLLM's --gpu-memory-utilization, read as its CPU backend reads VLLM_CPU_KVCACHE_SPACE:
    # the default-sized KV cache may take this fraction of the memory available at start-up
    # instead of half of it (kv_cache_memory, when set, wins).
    gpu_memory_utilization: float | None = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    # "fair" policy: tenant name -> weight (a dict, or "a=2,b=1" from the CLI); others weigh 1.
    tenant_weights: dict[str, float] | str | None = None
    max_logprobs: int = 20
    disable_log_stats: bool = False
    seed: int = 0
    attention_backend: str = "cpu"
    device: str = "cpu"
    quantization: str | None = None
    # quantization="gguf": each 32-wide block of an activation row as two int8 digits (16:
    # ~15 bits, greedy output on the dequantized model's tokens) or one (8: llama.cpp's own
    # activation precision; the batched kernel does half the integer work).
    gguf_activation_bits: int = 16
    kv_cache_dtype: str = "auto"
    # Decode-only steps of up to 96 requests through one torch.compile graph, compiled at
    # start-up (Inductor's output cached on disk): a third of Gemma 3 270M's forward at one
    # request; 15-20 s more start-up from the cache, 1-1.5 minutes the first time. None
    # (the default): compiled wherever the graph is tested bit-equal to the eager step
    # (runner/compile_choice.py says where not, and why); True asks for it anywhere; False
    # and enforce_eager (vLLM's name) keep every step eager.
    compile: bool | None = None
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    # None: "uni" for one worker, "mp" for several (vLLM's default).
    distributed_executor_backend: str | None = None
    cpu_threads_bind: str = "auto"
    # "auto": the checkpoint's weights; "dummy": seeded random weights of the config's
    # shapes, no weight file read (vLLM's name; for memory and speed measurements).
    load_format: str = "auto"
    # Speculative decoding (vLLM's `speculative_config`): a dict, its JSON, or None (off).
    speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None
    # LoRA adapters (vLLM's names): requests may name an adapter (`LoRARequest`); up to
    # max_loras run in one step, max_cpu_loras (default max_loras) stay loaded.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # KV tiers: a host-memory tier for blocks evicted from the pool (`kv_offload_memory`,
    # e.g. "8GiB"), a disk tier that outlives the process (`kv_offload_dir`), swapping a
    # preempted request's blocks to host memory instead of recomputing them
    # (`preemption_mode`), and prefill/decode disaggregation (`kv_transfer_config`).
    kv_offload_memory: int | str | None = None
    kv_offload_dir: str | None = None
    preemption_mode: str = "recompute"
    kv_transfer_config: KVTransferConfig | dict[str, Any] | str | None = None
    # vLLM's runner switch: "generate" (tokens) or "pooling" (embeddings: prefill only, the
    # final hidden states pooled by `pooler_config`, no KV kept after).
    runner: str = "generate"
    pooler_config: PoolerConfig | dict[str, Any] | str | None = None

    def __post_init__(self) -> None:
        # Checked here, before any model is loaded, so a typo fails in milliseconds.
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < 0:
            raise ValueError(
                f"max_logprobs must be a non-negative integer, got {self.max_logprobs}"
            )
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be a positive integer, got {self.max_model_len}")
        resolve_dtype(self.dtype)
        check_scheduling_policy(self.scheduling_policy)
        self.tenant_weights = parse_tenant_weights(self.tenant_weights)
        if self.tenant_weights and self.scheduling_policy != "fair":
            raise ValueError(
                "tenant_weights apply to scheduling_policy='fair' only, "
                f"got scheduling_policy={self.scheduling_policy!r}"
            )
        if self.kv_cache_memory is not None:
            parse_memory_size(self.kv_cache_memory)
        self._check_quantization()
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        self.parallel_config()  # a bad size, backend or binding fails here
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        self.lora_config()  # bad LoRA sizes fail here
        self._check_kv_tiers()
        self._check_runner()
        if self.compile is not None and not isinstance(self.compile, bool):
            raise ValueError(f"compile must be true, false or None, got {self.compile!r}")
        if self.compile and self.enforce_eager:
            raise ValueError(
                "compile and enforce_eager exclude each other: compile runs decode steps "
                "through torch.compile, enforce_eager keeps every step eager"
            )
        self._check_gpu_memory_utilization()

    def _check_gpu_memory_utilization(self) -> None:
        fraction = self.gpu_memory_utilization
        if fraction is None:
            return
        if isinstance(fraction, bool) or not isinstance(fraction, int | float):
            raise ValueError(f"gpu_memory_utilization must be a number, got {fraction!r}")
        if not 0 < fraction <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {fraction}")

    def _check_quantization(self) -> None:
        verify_quantization(self.quantization)
        if self.gguf_activation_bits not in GGUF_ACTIVATION_BITS:
            raise ValueError(
                f"gguf_activation_bits must be one of {list(GGUF_ACTIVATION_BITS)}, "
                f"got {self.gguf_activation_bits!r}"
            )
        if self.gguf_activation_bits != 16 and self.quantization != "gguf":
            raise ValueError(
                "gguf_activation_bits applies to quantization='gguf' only, "
                f"got quantization={self.quantization!r}"
            )
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"load_format must be one of {list(LOAD_FORMATS)}, got {self.load_format!r}"
            )
        if self.quantization is None:
            return
        # The int8 kernels are fbgemm's CPU kernels, fed fp32 activations.
        if torch.device(self.device).type != "cpu":
            raise ValueError(
                f"quantization={self.quantization!r} runs on the CPU only, "
                f"got device={self.device!r}"
            )
        if resolve_dtype(self.dtype) != torch.float32:
            raise ValueError(
                f"quantization={self.quantization!r} needs dtype float32 (or auto), "
                f"got {self.dtype!r}"
            )
        if self.quantization in CHECKPOINT_QUANTIZATION_METHODS and str(self.model).endswith(
            ".gguf"
        ):
            raise ValueError(
                f"quantization={self.quantization!r} reads a Hugging Face checkpoint stored "
                f"quantized; model {self.model!r} is a GGUF file (use quantization='gguf')"
            )
        if self.quantization == "gguf" and self.model and not str(self.model).endswith(".gguf"):
            raise ValueError(
                f"quantization='gguf' computes on a GGUF file's blocks; model {self.model!r} "
                "is not a .gguf file (use quantization='int8' for other checkpoints)"
            )

    def _check_kv_tiers(self) -> None:
        if self.kv_offload_memory is not None:
            parse_memory_size(self.kv_offload_memory, "kv_offload_memory")
        if self.kv_offload_dir is not None and (
            not isinstance(self.kv_offload_dir, str) or not self.kv_offload_dir
        ):
            raise ValueError(f"kv_offload_dir must be a folder path, got {self.kv_offload_dir!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {list(PREEMPTION_MODES)}, "
                f"got {self.preemption_mode!r}"
            )
        self.kv_transfer_config = KVTransferConfig.parse(self.kv_transfer_config)

    def _check_runner(self) -> None:
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {list(RUNNERS)}, got {self.runner!r}")
        if self.pooler_config is not None and self.runner != "pooling":
            raise ValueError("pooler_config needs runner='pooling'")
        if self.runner != "pooling":
            return
        self.pooler_config = PoolerConfig.parse(self.pooler_config)
        # A pooling request is one prefill: nothing is drafted, and no KV outlives it.
        if self.speculative_config is not None:
            raise ValueError("speculative_config does not apply to runner='pooling'")
        if self.uses_kv_tiers:
            raise ValueError(
                "KV tiers (kv_offload_memory, kv_offload_dir, preemption_mode='swap', "
                "kv_transfer_config) do not apply to runner='pooling': it keeps no KV"
            )

    @property
    def uses_kv_tiers(self) -> bool:
        return (
            self.kv_offload_memory is not None
            or self.kv_offload_dir is not None
            or self.preemption_mode != "recompute"
            or self.kv_transfer_config is not None
        )

    def lora_config(self) -> LoRAConfig | None:
        if not self.enable_lora:
            return None
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)

    def parallel_config(self) -> ParallelConfig:
        world_size = self.tensor_parallel_size * self.pipeline_parallel_size
        if not all(isinstance(v, int) and v >= 1 for v in (world_size, self.data_parallel_size)):
            world_size = 1  # ParallelConfig names the bad size
        return ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            data_parallel_size=self.data_parallel_size,
            distributed_executor_backend=(
                self.distributed_executor_backend or default_executor_backend(world_size)
            ),
            cpu_threads_bind=self.cpu_threads_bind,
        )

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        check_known_keys("engine argument", kwargs, {f.name for f in fields(cls)})
        return cls(**kwargs)
