"""Engine arguments as command-line flags: one `--flag-name` per `EngineArgs` field."""

from __future__ import annotations

import argparse
import dataclasses

from pagedllm.config import EXECUTOR_BACKENDS, KV_CACHE_DTYPES, QUANTIZATION_METHODS, EngineArgs

# One line of help per EngineArgs field (tests/test_cli.py checks every field has one).
ENGINE_ARG_HELP = {
    "model": "Hugging Face directory or .gguf file (default: SmolLM2-135M-Instruct)",
    "tokenizer": "tokenizer directory, if not the model's own",
    "skip_tokenizer_init": "load no tokenizer: prompts must be token ids, outputs are ids only",
    "dtype": "weights' and activations' dtype: auto (the checkpoint's), float32 or bfloat16",
    "max_model_len": "context window in tokens (default: the model's)",
    "block_size": "tokens per KV cache block",
    "kv_cache_memory": "memory for the paged KV cache, e.g. 4GiB (default: enough for "
    "max_num_seqs sequences at max_model_len, at most 4 GiB)",
    "max_num_batched_tokens": "token budget of one engine step (prefill chunks and decodes)",
    "max_num_seqs": "most requests running at once",
    "enable_prefix_caching": "share the KV of equal prompt prefixes between requests",
    "scheduling_policy": "fcfs (arrival order), priority (lowest priority value first) or "
    "fair (weighted fair share between tenants: deficit round-robin over the token budget, "
    "seats and KV cache; a tenant that floods the queue cannot starve another)",
    "tenant_weights": "fair policy: tenant weights as name=weight,name=weight (e.g. "
    "gold=4,free=1); a tenant not named weighs 1",
    "max_logprobs": "most logprobs / prompt_logprobs a request may ask for",
    "disable_log_stats": "no periodic throughput / KV usage log line",
    "seed": "random seed of the engine's unseeded sampling",
    "attention_backend": "cpu (the C++ paged-attention kernel) or torch (the reference)",
    "device": "torch device the model runs on",
    "quantization": f"weight quantization: {', '.join(QUANTIZATION_METHODS)} (default: none)",
    "kv_cache_dtype": f"KV cache dtype: {', '.join(KV_CACHE_DTYPES)} (auto: the model's dtype)",
    "compile": "run decode steps through one torch.compile graph, compiled at start-up",
    "enforce_eager": "never compile: every step runs eagerly (the default)",
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
    'model\'s own quantized weights draft); "disable_by_batch_size": N stops speculating in '
    "steps of N or more requests (default: off)",
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
    "on resume; the default) or swap (saved to host memory and loaded back)",
    "kv_transfer_config": "prefill/decode disaggregation as JSON, vLLM's keys: "
    """'{"kv_role": "kv_producer", "kv_connector_extra_config": {"peer": "HOST:PORT"}}' on """
    """the prefill instance, '{"kv_role": "kv_consumer", "kv_port": PORT}' on the decode """
    "instance (it listens on kv_ip:kv_port, 127.0.0.1:14579 by default); route requests "
    "through `pagedllm proxy` (default: off)",
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


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One `--flag-name` per EngineArgs field (vLLM's names), typed from the field's default."""
    group = parser.add_argument_group("engine")
    for field in dataclasses.fields(EngineArgs):
        if field.name == "model":
            continue
        flags = ["--" + field.name.replace("_", "-")]
        if field.name in _SHORT_FLAGS:
            flags.insert(0, _SHORT_FLAGS[field.name])
        help_text = ENGINE_ARG_HELP[field.name]
        if field.type in ("bool", bool):
            group.add_argument(
                *flags,
                action=argparse.BooleanOptionalAction,
                default=field.default,
                help=help_text,
            )
        elif field.type in ("int", int, "int | None"):
            group.add_argument(*flags, type=int, default=field.default, help=help_text)
        else:
            group.add_argument(*flags, default=field.default, help=help_text)
    group.add_argument("--model", default=None, help=ENGINE_ARG_HELP["model"])


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
