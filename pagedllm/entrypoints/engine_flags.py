"""Engine arguments as command-line flags: one `--flag-name` per `EngineArgs` field, each in
its help section (model, cache, scheduler, ...), each help line saying its default and units;
and vLLM's engine flags that have no field here (`vllm_flags`), warned about when given."""

from __future__ import annotations

import argparse
import dataclasses

from pagedllm.config import EXECUTOR_BACKENDS, KV_CACHE_DTYPES, QUANTIZATION_METHODS, EngineArgs
from pagedllm.entrypoints.config_file import add_config_arg
from pagedllm.entrypoints.flag_help import FlagParser, section
from pagedllm.entrypoints.vllm_flags import (
    ENGINE_FLAGS,
    add_vllm_engine_flags,
    compat_warnings,
    swap_space_bytes,
    warn_once,
)

# One line of help per EngineArgs field (tests/test_cli.py checks every field has one). A
# default that is not None or False is appended by flag_help; a None default is said here in
# words (what leaving it unset means).
ENGINE_ARG_HELP = {
    "model": "Hugging Face directory or .gguf file (default: SmolLM2-135M-Instruct)",
    "tokenizer": "tokenizer directory or .gguf file (default: the model's own)",
    "skip_tokenizer_init": "load no tokenizer: prompts must be token ids, outputs are ids only",
    "dtype": "weights' and activations' dtype: auto (the checkpoint's), float32 or bfloat16",
    "max_model_len": "context window in tokens, prompt and output together (default: the model's)",
    "block_size": "tokens per KV cache block",
    "kv_cache_memory": "bytes for the paged KV cache, a number or with a unit: 512MiB, 4GiB "
    "(default: enough for max_num_seqs + 1 sequences at max_model_len, at most half the "
    "memory available at start-up)",
    "gpu_memory_utilization": "vLLM's fraction of device memory, read here as vLLM's CPU "
    "backend reads VLLM_CPU_KVCACHE_SPACE: the KV cache may take up to this fraction of the "
    "memory available at start-up, split between the ranks and engine cores; it still takes "
    "no more than max_num_seqs + 1 sequences at max_model_len need, and --kv-cache-memory "
    "wins (default: none: half)",
    "max_num_batched_tokens": "tokens one engine step may compute (prefill chunks and "
    "decodes together)",
    "max_num_seqs": "most sequences (requests) running at once in an engine step",
    "enable_prefix_caching": "share the KV of equal prompt prefixes between requests",
    "scheduling_policy": "fcfs (arrival order), priority (lowest priority value first) or "
    "fair (weighted fair share between tenants: deficit round-robin over the token budget, "
    "seats and KV cache; a tenant that floods the queue cannot starve another)",
    "tenant_weights": "fair policy: tenant weights as name=weight,name=weight (e.g. "
    "gold=4,free=1); a tenant not named weighs 1 (default: every tenant weighs 1)",
    "max_logprobs": "most logprobs / prompt_logprobs (tokens per position) a request may ask for",
    "disable_log_stats": "no periodic throughput / KV usage log line (one every 10 seconds of "
    "activity)",
    "seed": "random seed of the engine's unseeded sampling",
    "attention_backend": "cpu (the C++ paged-attention kernel) or torch (the reference)",
    "device": "torch device the model runs on",
    "quantization": f"weight quantization: {', '.join(QUANTIZATION_METHODS)} (default: none)",
    "gguf_activation_bits": "--quantization gguf: activations quantized to 16 bits (two int8 "
    "digits per value: greedy output on the dequantized model's tokens) or 8 (one digit, "
    "llama.cpp's precision: batched steps up to ~1.8x faster, tokens may differ)",
    "kv_cache_dtype": f"KV cache dtype: {', '.join(KV_CACHE_DTYPES)} (auto: the model's dtype)",
    "compile": "run decode steps through one torch.compile graph, compiled at start-up "
    "(15-20 s from Inductor's cache, 1-1.5 min the first time). Default: wherever that graph "
    "is tested bit-equal to the eager step (float32 or --quantization gguf, one rank); "
    "--no-compile or --enforce-eager: never",
    "enforce_eager": "keep every step eager (vLLM's flag): no torch.compile at start-up; "
    "excludes --compile",
    "tensor_parallel_size": "ranks that split every layer (heads, MLP columns, vocabulary)",
    "pipeline_parallel_size": "pipeline stages that split the layers",
    "data_parallel_size": "engine cores, each with a whole copy of the model, its own "
    "scheduler and KV cache, behind one server (requests routed by prefix and load)",
    "distributed_executor_backend": "how the engine core runs its workers: "
    f"{', '.join(EXECUTOR_BACKENDS)} (uni: one worker in the core's process; mp: one process "
    "per rank on this host; ray: Ray actors, across hosts; default: uni for one rank, mp "
    "for several)",
    "load_format": "auto: the checkpoint's weights; dummy: seeded random weights of the "
    "config's shapes, no weight file read (a directory with only config.json will do)",
    "speculative_config": "speculative decoding as JSON, vLLM's keys, e.g. "
    '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\'; methods: '
    'ngram (prompt lookup), suffix (suffix decoding), draft_model (with "model": a smaller '
    'model with the same tokenizer), self_quantized (with "quantization": gguf or int8: the '
    'model\'s own quantized weights draft), eagle3 / eagle (with "model": an EAGLE-3 / EAGLE '
    "head's directory), medusa (with \"model\": Medusa heads' directory, "
    '"num_speculative_tokens" at most its heads); "disable_by_batch_size": N stops speculating in '
    "steps of N or more running requests, and an EAGLE head's requests computed in such a step "
    "for good (default: off: no speculation; with a config, disable_by_batch_size unset "
    "speculates at every batch size)",
    "enable_lora": "serve LoRA adapters (PEFT format) on top of the model: each request may "
    "name one, and requests of different adapters run in one batch",
    "max_loras": "most LoRA adapters in one batch (each holds a slot of weights in every "
    "LoRA layer); requests of more wait a step",
    "max_lora_rank": "largest LoRA rank an adapter may have (sizes the slots; an adapter of a "
    "higher rank is refused)",
    "max_cpu_loras": "most LoRA adapters kept loaded in memory, least recently used dropped "
    "beyond it (default: max_loras; at least max_loras)",
    "kv_offload_memory": "host-memory KV tier, e.g. 8GiB: prefix blocks evicted from the pool "
    "are kept there and loaded back on a later hit instead of recomputed (default: none; "
    "4 GiB with --preemption-mode swap, kv_buffer_size for a KV consumer, 1 GiB of staging "
    "with --kv-offload-dir)",
    "kv_offload_dir": "disk KV tier: a folder where every cached prefix block is also written "
    "(keyed by model, dtypes, block size, salt and block hash; checksummed), found again "
    "after a restart (default: none)",
    "preemption_mode": "what a preempted request's KV becomes: recompute (freed, recomputed "
    "on resume) or swap (saved to host memory and loaded back)",
    "kv_transfer_config": "prefill/decode disaggregation as JSON, vLLM's keys: "
    """'{"kv_role": "kv_producer", "kv_connector_extra_config": {"peer": "HOST:PORT"}}' on """
    """the prefill instance, '{"kv_role": "kv_consumer", "kv_port": PORT}' on the decode """
    "instance (it listens on kv_ip:kv_port, 127.0.0.1:14579 by default); route requests "
    "through `pagedllm proxy` (default: off)",
    "runner": "generate (tokens) or pooling (embeddings: /v1/embeddings and LLM.embed; "
    "prefill only, no KV kept after)",
    "pooler_config": "runner=pooling: how hidden states become one vector, as JSON, vLLM's "
    """keys: '{"pooling_type": "last"|"mean"|"cls", "normalize": true}' (default: last, """
    "normalized)",
    "cpu_threads_bind": "CPU cores each rank's threads run on: auto (one rank per NUMA node "
    "when there are several, else the cores split evenly), nobind, or one list per rank "
    "such as 0-7|8-15",
}

# vLLM's short forms.
_SHORT_FLAGS = {
    "tensor_parallel_size": "-tp",
    "pipeline_parallel_size": "-pp",
    "data_parallel_size": "-dp",
}
# vLLM's other names of a field: its exact KV cache size in bytes.
_ALIASES = {"kv_cache_memory": "--kv-cache-memory-bytes"}


# Each field's help section (vLLM's config groups); a field not listed goes to "engine".
_SECTIONS = {
    "model": ("model", "tokenizer", "skip_tokenizer_init", "dtype", "max_model_len",
              "quantization", "gguf_activation_bits", "load_format", "seed", "max_logprobs",
              "runner", "pooler_config"),
    "cache": ("block_size", "kv_cache_memory", "gpu_memory_utilization", "kv_cache_dtype",
              "enable_prefix_caching"),
    "scheduler": ("max_num_batched_tokens", "max_num_seqs", "scheduling_policy",
                  "tenant_weights", "preemption_mode"),
    "parallel": ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
                 "distributed_executor_backend", "cpu_threads_bind"),
    "device": ("device", "attention_backend", "compile", "enforce_eager"),
    "lora": ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras"),
    "speculative": ("speculative_config",),
    "kv-transfer": ("kv_offload_memory", "kv_offload_dir", "kv_transfer_config"),
    "observability": ("disable_log_stats",),
}  # fmt: skip
_SECTION_OF = {name: title for title, names in _SECTIONS.items() for name in names}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One `--flag-name` per EngineArgs field (vLLM's names), typed from the field's default,
    in its section; and `--config FILE.yaml` where the parser can expand it (a FlagParser)."""
    if isinstance(parser, FlagParser) and "--config" not in parser._option_string_actions:
        add_config_arg(parser)
    fields = sorted(dataclasses.fields(EngineArgs), key=lambda f: f.name != "model")
    for field in fields:
        group = section(parser, _SECTION_OF.get(field.name, "engine"))
        flags = ["--" + field.name.replace("_", "-")]
        if field.name in _SHORT_FLAGS:
            flags.insert(0, _SHORT_FLAGS[field.name])
        if field.name in _ALIASES:
            flags.append(_ALIASES[field.name])
        help_text = ENGINE_ARG_HELP[field.name]
        if field.type in ("bool", bool, "bool | None"):  # None: the engine decides
            group.add_argument(
                *flags,
                action=argparse.BooleanOptionalAction,
                default=field.default,
                help=help_text,
            )
        elif field.type in ("int", int, "int | None"):
            group.add_argument(*flags, type=int, default=field.default, help=help_text)
        elif field.type in ("float", float, "float | None"):
            group.add_argument(*flags, type=float, default=field.default, help=help_text)
        else:
            group.add_argument(*flags, default=field.default, help=help_text)
    add_vllm_engine_flags(parser)


def engine_args_from(namespace: argparse.Namespace) -> EngineArgs:
    """The engine arguments the flags give; vLLM's flags without a field here are mapped
    (`--swap-space` in swap mode) or warned about, once, before anything loads."""
    values = {f.name: getattr(namespace, f.name) for f in dataclasses.fields(EngineArgs)}
    warn_once(compat_warnings(namespace, ENGINE_FLAGS, values))
    swap_bytes = swap_space_bytes(namespace, values)
    if swap_bytes is not None:
        values["kv_offload_memory"] = swap_bytes
    return EngineArgs(**values)


def llm_from_args(namespace: argparse.Namespace, model: str | None = None):
    """The `LLM` the engine flags describe; `model` overrides `--model` when given."""
    from pagedllm import LLM

    engine_args = engine_args_from(namespace)
    if model is not None:
        engine_args.model = model
    return LLM(**dataclasses.asdict(engine_args))
