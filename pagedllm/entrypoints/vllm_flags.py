"""vLLM's flags that pagedllm has no flag of its own for, so a `vllm serve` launch line runs
unchanged.

Each is accepted with vLLM's name and value type. One whose value asks for what pagedllm
does anyway (`--enable-chunked-prefill`, `--generation-config vllm`) is silent; any other
value is one warning line at start-up naming the flag and why it has no effect here. The
flags that do mean something on the CPU are real flags elsewhere: `--gpu-memory-utilization`
(an engine argument), `--uvicorn-log-level`, `--root-path`, `--disable-log-requests` (serve's);
`--swap-space` sizes the host swap tier under `--preemption-mode swap` (`swap_space_bytes`);
`--guided-decoding-backend` refuses a backend this server does not have.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from typing import Any

from pagedllm.entrypoints.flag_help import section
from pagedllm.structured_output.registry import KNOWN_BACKENDS

logger = logging.getLogger("pagedllm")

GIB = 1024**3

# Why a model-fetching flag means nothing here.
_LOCAL_MODELS = "models are local directories or .gguf files here, never fetched from a hub"
_NO_GENERATION_CONFIG = (
    "a model's generation_config.json sampling defaults are not applied here: a field a "
    "request leaves unset takes the OpenAI/vLLM default (vLLM's --generation-config vllm)"
)


@dataclass(frozen=True)
class CompatFlag:
    """One vLLM flag accepted for compatibility. `kind` None is a --x/--no-x switch, else the
    value's type; a value in `same` asks for what pagedllm does anyway (no warning)."""

    name: str
    section: str
    help: str
    why: str
    kind: type | None = None
    same: tuple[Any, ...] = ()
    metavar: str | None = None

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")


# Engine flags: every subcommand with engine arguments takes them (as vLLM's EngineArgs).
ENGINE_FLAGS = (
    CompatFlag("trust-remote-code", "model", "vLLM: trust remote code (e.g. from "
               "HuggingFace) when downloading the model and tokenizer",
               "pagedllm never runs code from a model's repository: it runs its own "
               "implementation of each architecture it supports (a model it has none of is "
               "refused)", same=(False,)),
    CompatFlag("revision", "model", "vLLM: the specific model version to use (a branch, "
               "tag or commit id)", _LOCAL_MODELS, str, metavar="REV"),
    CompatFlag("tokenizer-revision", "model", "vLLM: the specific tokenizer version to use",
               _LOCAL_MODELS, str, metavar="REV"),
    CompatFlag("code-revision", "model", "vLLM: the specific revision of the model code on "
               "the Hugging Face Hub", _LOCAL_MODELS, str, metavar="REV"),
    CompatFlag("download-dir", "model", "vLLM: directory to download and load the weights",
               _LOCAL_MODELS, str, metavar="DIR"),
    CompatFlag("tokenizer-mode", "model", "vLLM: tokenizer mode (auto, slow, mistral, "
               "custom)", "the model's own tokenizer is always loaded as it is stored",
               str, same=("auto",)),
    CompatFlag("hf-overrides", "model", "vLLM: extra arguments for the Hugging Face config, "
               "as JSON", "the model's config is read as it is stored", str, metavar="JSON"),
    CompatFlag("generation-config", "model", "vLLM: where the generation config is loaded "
               "from: auto (the model's), vllm (none) or a folder", _NO_GENERATION_CONFIG, str,
               same=("vllm",)),
    CompatFlag("override-generation-config", "model", "vLLM: overrides of the generation "
               "config, as JSON", _NO_GENERATION_CONFIG, str, metavar="JSON"),
    CompatFlag("disable-sliding-window", "model", "vLLM: disable sliding window, capping to "
               "the sliding window size", "sliding-window layers always attend over their "
               "window", same=(False,)),
    CompatFlag("limit-mm-per-prompt", "model", "vLLM: most multimodal inputs of each "
               "modality per prompt, as JSON", "models here take text only", str,
               metavar="JSON"),
    CompatFlag("mm-processor-kwargs", "model", "vLLM: arguments of the multimodal "
               "processor, as JSON", "models here take text only", str, metavar="JSON"),
    CompatFlag("enable-chunked-prefill", "scheduler", "vLLM: chunk prefill requests by "
               "max_num_batched_tokens", "prefill is always chunked: "
               "each step takes up to --max-num-batched-tokens tokens of prompts and "
               "decodes together", same=(True,)),
    CompatFlag("num-scheduler-steps", "scheduler", "vLLM: most forward steps per scheduler "
               "call", "one scheduling decision is made per engine step (vLLM's V1 engine "
               "dropped multi-step scheduling too)", int, same=(1,)),
    CompatFlag("async-scheduling", "scheduler", "vLLM: schedule the next step while the "
               "current one runs", "steps are scheduled one after another",
               same=(False,)),
    CompatFlag("use-v2-block-manager", "scheduler", "vLLM (removed): use the v2 block "
               "manager", "the paged KV cache has one block manager"),
    CompatFlag("swap-space", "cache", "vLLM: CPU swap space per GPU in GiB",
               "it sizes the host swap tier (as --kv-offload-memory) only under "
               "--preemption-mode swap without --kv-offload-memory (by default preempted "
               "requests are recomputed)", float,
               metavar="GIB"),
    CompatFlag("cpu-offload-gb", "cache", "vLLM: GiB of weights offloaded to CPU memory",
               "weights already live in host memory on the CPU", float, same=(0,),
               metavar="GIB"),
    CompatFlag("num-gpu-blocks-override", "cache", "vLLM: the number of KV blocks to use "
               "instead of the profiled one", "size the KV pool with --kv-cache-memory "
               "(bytes) or --gpu-memory-utilization", int),
    CompatFlag("calculate-kv-scales", "cache", "vLLM: compute fp8 KV scales dynamically",
               "8-bit KV caches here keep one scale per token, computed as it is written",
               same=(False,)),
    CompatFlag("max-seq-len-to-capture", "device", "vLLM: longest sequence covered by CUDA "
               "graphs", "there are no CUDA graphs on the CPU (--compile is this engine's "
               "graph capture)", int),
    CompatFlag("enable-sleep-mode", "device", "vLLM: let the engine sleep, freeing device "
               "memory", "there is no device memory to free on the CPU", same=(False,)),
    CompatFlag("compilation-config", "device", "vLLM: torch.compile settings, as JSON or an "
               "optimization level", "decode steps compile to one torch.compile graph by "
               "default where it is exact; --enforce-eager turns it off", str, metavar="CONFIG"),
    CompatFlag("disable-custom-all-reduce", "parallel", "vLLM: use NCCL's all-reduce "
               "instead of vLLM's custom kernel", "ranks all-reduce through torch.distributed "
               "on the CPU here: there is no custom GPU kernel to turn off"),
    CompatFlag("max-parallel-loading-workers", "parallel", "vLLM: load the model in "
               "sequential batches of this many workers", "each rank reads its own share of "
               "the weights", int),
    CompatFlag("enable-expert-parallel", "parallel", "vLLM: expert parallelism for MoE "
               "layers", "no mixture-of-experts layer is split over ranks here",
               same=(False,)),
    CompatFlag("otlp-traces-endpoint", "observability", "vLLM: the OpenTelemetry traces "
               "endpoint", "there is no OpenTelemetry tracing here (Prometheus metrics at "
               "/metrics, per-request lines with --audit-log)", str, metavar="URL"),
)  # fmt: skip

# `serve`'s own: the HTTP side.
SERVE_FLAGS = (
    CompatFlag("max-log-len", "observability", "vLLM: most prompt characters or ids printed "
               "in the request log", "request log lines hold lengths and sampling parameters, "
               "never prompt text: there is nothing to cut", int),
    CompatFlag("enable-log-outputs", "observability", "vLLM: log each request's output "
               "(with --enable-log-requests)", "request logs never hold generated text",
               same=(False,)),
    CompatFlag("enable-server-load-tracking", "observability", "vLLM: track the server's "
               "load for GET /load", "there is no /load route here: running and waiting "
               "requests are in /metrics", same=(False,)),
    CompatFlag("disable-frontend-multiprocessing", "frontend", "vLLM: run the engine in the "
               "HTTP server's process", "the HTTP server and the engine core always run in "
               "separate processes", same=(False,)),
    CompatFlag("api-server-count", "frontend", "vLLM: HTTP server processes",
               "one HTTP process serves every request", int, same=(1,)),
    CompatFlag("response-role", "frontend", "vLLM: the role name returned when "
               "add_generation_prompt is true", "replies always carry the role assistant",
               str, same=("assistant",)),
    CompatFlag("chat-template-content-format", "frontend", "vLLM: how message content is "
               "rendered in the chat template: auto, string or openai", "message content is "
               "always rendered as one string (text parts joined)", str,
               same=("auto", "string")),
    CompatFlag("return-tokens-as-token-ids", "frontend", "vLLM: logprob tokens as "
               "'token_id:N' strings", "logprob tokens are returned as text", same=(False,)),
    CompatFlag("enable-prompt-tokens-details", "frontend", "vLLM: usage.prompt_tokens_details "
               "in responses", "usage has no prompt_tokens_details here (cached prompt tokens "
               "are counted in /metrics and the audit log)", same=(False,)),
    CompatFlag("enable-request-id-headers", "frontend", "vLLM: X-Request-Id on every "
               "response", "every response always carries X-Request-Id",
               same=(True,)),
)  # fmt: skip

# vLLM's names of the structured-output backends; "auto" lets the server choose.
_STRUCTURED_BACKEND_NAMES = ("auto", *KNOWN_BACKENDS)

# Flags already warned about in this process: each warns once, at start-up.
_warned: set[str] = set()


def guided_decoding_backend(value: str) -> str:
    """vLLM's `--guided-decoding-backend`: a backend this server has, else refused naming
    the ones it has (a silent switch to another backend would change outputs)."""
    if value not in _STRUCTURED_BACKEND_NAMES:
        served = ", ".join(repr(name) for name in KNOWN_BACKENDS)
        raise argparse.ArgumentTypeError(
            f"{value!r} is not available; this server has {served} (or 'auto')"
        )
    return value


def add_vllm_engine_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM's engine flags pagedllm has no counterpart of, each in its section."""
    _add_flags(parser, ENGINE_FLAGS)
    section(parser, "model").add_argument(
        "--guided-decoding-backend",
        type=guided_decoding_backend,
        default=None,
        metavar="NAME",
        help="vLLM: the engine's default structured-output backend; "
        f"{', '.join(_STRUCTURED_BACKEND_NAMES)} here, any other is refused (default: "
        "xgrammar)",
    )


def add_vllm_serve_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM's serve flags that have no effect here."""
    _add_flags(parser, SERVE_FLAGS)


def _add_flags(parser: argparse.ArgumentParser, flags: tuple[CompatFlag, ...]) -> None:
    for flag in flags:
        # vLLM's words, then what the flag is here.
        help_text = f"{flag.help}; here: {flag.why} (default: unset)"
        group = section(parser, flag.section)
        if flag.kind is None:
            group.add_argument(
                f"--{flag.name}",
                action=argparse.BooleanOptionalAction,
                default=None,
                help=help_text,
            )
        else:
            group.add_argument(
                f"--{flag.name}",
                type=flag.kind,
                default=None,
                metavar=flag.metavar,
                help=help_text,
            )


def swap_space_bytes(namespace: argparse.Namespace, values: dict[str, Any]) -> int | None:
    """`--swap-space GIB` as the host swap tier's bytes (`kv_offload_memory`): only where
    preempted requests are swapped and the tier's size is not given in bytes."""
    gib = getattr(namespace, "swap_space", None)
    if not gib or gib < 0 or values.get("preemption_mode") != "swap":
        return None
    if values.get("kv_offload_memory") is not None:
        return None
    return int(gib * GIB)


def compat_warnings(
    namespace: argparse.Namespace,
    flags: tuple[CompatFlag, ...],
    values: dict[str, Any] | None = None,
) -> list[str]:
    """One line per flag of `flags` given with a value that has no effect here. `values`:
    the engine arguments as given, for `--swap-space`, which maps onto them in swap mode,
    and `--gpu-memory-utilization`, which an exact KV cache size overrides."""
    lines = []
    for flag in flags:
        value = getattr(namespace, flag.dest, None)
        if value is None or value in flag.same:
            continue
        if flag.dest == "swap_space" and swap_space_bytes(namespace, values or {}) is not None:
            continue
        lines.append(f"{_as_given(flag, value)} has no effect: {flag.why}")
    return lines + _exact_size_wins(values or {})


def _as_given(flag: CompatFlag, value: Any) -> str:
    if flag.kind is None:
        return f"--{flag.name}" if value else f"--no-{flag.name}"
    return f"--{flag.name} {value}"


def _exact_size_wins(values: dict[str, Any]) -> list[str]:
    """--gpu-memory-utilization beside an exact KV cache size: the size wins, as in vLLM."""
    fraction = values.get("gpu_memory_utilization")
    if fraction is None or values.get("kv_cache_memory") is None:
        return []
    return [
        f"--gpu-memory-utilization {fraction} has no effect: --kv-cache-memory sets the KV "
        "cache's size"
    ]


def warn_once(lines: list[str]) -> None:
    """Log each line once per process (a command may build its engine arguments twice)."""
    for line in lines:
        if line not in _warned:
            _warned.add(line)
            logger.warning("%s", line)
