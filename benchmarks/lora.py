"""Multi-LoRA on the default model: W1-shaped throughput with 8 adapters against the base
model alone, the LoRA share of the steps, adapter load time and memory per adapter.

W1's shape: `--num-prompts` (64) prompts of `--input-len` (256) random token ids, each
generating `--output-len` (128) tokens (EOS ignored), all submitted at once, greedy.
Configurations (`--configs`):
- "base": the engine without LoRA;
- "enabled": `enable_lora` on, every request on the base model (what LoRA costs those
  that do not use it);
- "lora": `--num-adapters` (8) random rank-`--rank` (16) adapters on every projection,
  assigned round-robin, `max_loras` = the number of adapters.

The adapters are PEFT files (adapter_config.json + adapter_model.safetensors) of the
model's real projection shapes with seeded random weights, written to a temporary
directory. Each configuration gets its own engine and a short warm-up; rounds interleave
over the engines so the machine's drift hits all alike. Reported: requests/s and output
tokens/s (median round), the ratio to "base", and for "lora" the share of the wall time
spent in the LoRA deltas (every `apply_lora` call timed), the time to read an adapter and
write it into a slot, and the bytes of one adapter in memory and of its slot.

    .venv/bin/python -m benchmarks.lora [--num-prompts 64] [--input-len 256]
        [--output-len 128] [--rounds 3] [--configs base,enabled,lora] [--output-json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.lora.model import layers as lora_layers
from pagedllm.lora.peft import projection_shapes, read_adapter


def write_adapter(directory: Path, shapes: dict[str, tuple[int, int]], rank: int, seed: int):
    """A PEFT LoRA adapter on every projection, seeded random A and B."""
    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (in_features, out_features) in shapes.items():
        prefix = f"base_model.model.{module}"
        tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator)
        tensors[f"{prefix}.lora_B.weight"] = 0.01 * torch.randn(
            out_features, rank, generator=generator
        )
    save_file(tensors, directory / "adapter_model.safetensors")
    projections = sorted({module.rsplit(".", 1)[-1] for module in shapes})
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank}
    (directory / "adapter_config.json").write_text(
        json.dumps(config | {"target_modules": projections})
    )
    return directory


class LoRATimer:
    """Seconds spent in `apply_lora` (every LoRA layer's deltas) while it is installed."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._original = lora_layers.apply_lora

    def __enter__(self) -> LoRATimer:
        original = self._original

        def timed(*args):
            started = time.perf_counter()
            result = original(*args)
            self.seconds += time.perf_counter() - started
            return result

        lora_layers.apply_lora = timed
        return self

    def __exit__(self, *exc) -> None:
        lora_layers.apply_lora = self._original


def build(name: str, args, num_adapters: int) -> LLM:
    # 1.5 GiB holds W1 whole (~1.1 GB of KV); the default 4 GiB per engine would have the
    # engines fault their pools in while the others are timed.
    settings = {
        "max_model_len": args.input_len + args.output_len,
        "max_num_seqs": 256,
        "kv_cache_memory": args.kv_cache_memory,
    }
    if name != "base":
        settings |= {
            "enable_lora": True,
            "max_loras": max(1, num_adapters),
            "max_lora_rank": args.rank,
            "max_cpu_loras": max(1, num_adapters),
        }
    return LLM(**settings)


def run_once(llm: LLM, prompts, loras, params) -> float:
    started = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    return time.perf_counter() - started


def adapter_costs(llm: LLM, lora: LoRARequest) -> dict:
    """Reading the adapter from disk, writing it into a slot, and its sizes."""
    runner = llm.model_runner
    manager = runner.lora_manager
    config = llm.llm_engine.config
    started = time.perf_counter()
    adapter = read_adapter(
        lora, projection_shapes(config.model_config), config.lora_config.max_lora_rank
    )
    read_seconds = time.perf_counter() - started
    started = time.perf_counter()
    manager._load_slot(0, adapter)
    slot_seconds = time.perf_counter() - started
    return {
        "read_ms": 1e3 * read_seconds,
        "slot_write_ms": 1e3 * slot_seconds,
        "adapter_mib": adapter.num_bytes / 2**20,
        "slot_mib": manager.slot_bytes / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kv-cache-memory", default="1536MiB")
    parser.add_argument("--configs", default="base,enabled,lora")
    parser.add_argument("--output-json", type=Path)
    args = parser.parse_args()
    names = args.configs.split(",")
    rng = np.random.default_rng(0)
    prompts = [
        {"prompt_token_ids": rng.integers(100, 40000, args.input_len).tolist()}
        for _ in range(args.num_prompts)
    ]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    workdir = Path(tempfile.mkdtemp(prefix="pagedllm-lora-"))
    engines = {name: build(name, args, args.num_adapters) for name in names}
    any_engine = next(iter(engines.values()))
    shapes = projection_shapes(any_engine.llm_engine.config.model_config)
    adapters = [
        LoRARequest(f"adapter{i}", i + 1, str(write_adapter(workdir / f"a{i}", shapes, rank, i)))
        for i, rank in enumerate([args.rank] * args.num_adapters)
    ]
    loras = {
        name: [adapters[i % len(adapters)] for i in range(len(prompts))] if name == "lora" else None
        for name in names
    }
    num_warm_up = 2 * args.num_adapters
    for name, llm in engines.items():  # warm-up: every adapter read, every path run once
        warm_loras = loras[name][:num_warm_up] if loras[name] else None
        run_once(llm, prompts[:num_warm_up], warm_loras, params)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    lora_seconds = []
    for _ in range(args.rounds):
        for name, llm in engines.items():
            gc.collect()
            with LoRATimer() as timer:
                seconds[name].append(run_once(llm, prompts, loras[name], params))
            if name == "lora":
                lora_seconds.append(timer.seconds / seconds[name][-1])
    results = {}
    for name in names:
        median = statistics.median(seconds[name])
        results[name] = {
            "seconds": seconds[name],
            "requests_per_s": len(prompts) / median,
            "output_tokens_per_s": len(prompts) * args.output_len / median,
        }
    if "base" in results:
        for name in names:
            results[name]["vs_base"] = statistics.median(seconds["base"]) / statistics.median(
                seconds[name]
            )
    if "lora" in engines:
        results["lora"]["lora_share"] = statistics.median(lora_seconds)
        results["lora"] |= adapter_costs(engines["lora"], adapters[0])
    for name, result in results.items():
        line = (
            f"{name:8s} {result['requests_per_s']:.3f} req/s "
            f"{result['output_tokens_per_s']:.1f} tok/s"
        )
        if "vs_base" in result:
            line += f"  x{result['vs_base']:.3f} of base"
        if "lora_share" in result:
            line += f"  LoRA share {100 * result['lora_share']:.1f}%"
        print(line)
    if "lora" in results:
        lora = results["lora"]
        print(
            f"adapter: read {lora['read_ms']:.1f} ms, slot write {lora['slot_write_ms']:.1f} ms, "
            f"{lora['adapter_mib']:.1f} MiB loaded, {lora['slot_mib']:.1f} MiB per slot"
        )
    if args.output_json:
        settings = vars(args) | {"output_json": str(args.output_json)}
        args.output_json.write_text(json.dumps({"args": settings, "results": results}, indent=1))


if __name__ == "__main__":
    main()
