"""Peak resident memory of each rank while loading a checkpoint stored packed (GPTQ, AWQ or
compressed-tensors W4A16, group 128), over tensor-parallel ranks or pipeline stages: what
reading only a rank's rows and a stage's layers (`model/layers/packed_reads.py`) leaves
resident, against the checkpoint's size.

The checkpoint is a random one (`benchmarks.random_gptq`) of a small-but-not-tiny Llama shape
(hidden 2048 and intermediate 8192 as Llama-3.2-1B, 8 layers: 0.25 GB of packed projections
and a 0.13 GB fp16 embedding), written once under pagedllm's cache root. Two figures a rank:

- `swap_peak_rss_mb`: the packed layers' read and swap alone (`keep_*_weights`), each rank
  built in a child process of its own under a stand-in tensor-parallel group: its resident
  memory before, its peak during (VmHWM, reset first) and after;
- `engine_rank_peak_rss_gb`: each engine rank's peak over its whole start (VmHWM of the
  worker processes, or of this process with one rank), whose later steps (the weights
  moved to huge pages, the first step) may set it instead of loading.

    .venv/bin/python -m benchmarks.packed_load_memory [--format gptq-4bit-g128] [--tp 2] [--pp 1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.parallel_memory import LlamaShape
from benchmarks.random_gptq import FORMATS, write_random_packed
from pagedllm.utils import cache_root

SHAPE = LlamaShape("packed-load-8l", 2048, 8192, 8, 32, 8, 32000, tie_word_embeddings=True)
WORKER_MARK = b"spawn_main"  # a spawned worker's command line


def checkpoint(fmt: str) -> Path:
    directory = cache_root() / "models" / f"random-{SHAPE.name}-{fmt}"
    if not (directory / "config.json").exists():  # written last: a whole checkpoint
        write_random_packed(directory, SHAPE, fmt)
    return directory


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children = (task / "children").read_text().split()
        found += [int(child) for child in children]
    return found


def _descendants(pid: int) -> list[int]:
    found, pending = [], _children(pid)
    while pending:
        child = pending.pop()
        found.append(child)
        pending += _children(child)
    return sorted(found)


def peak_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"process {pid} reports no VmHWM")


def rank_peaks(tp: int, pp: int) -> list[int]:
    """Each rank's peak resident bytes, in the order the workers started."""
    if tp * pp == 1:
        return [peak_rss_bytes(os.getpid())]
    workers = [
        pid
        for pid in _descendants(os.getpid())
        if WORKER_MARK in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]
    return [peak_rss_bytes(pid) for pid in workers]


def _status_mb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) // 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def swap_child(directory: Path, rank: int, tp: int) -> dict:
    """Runs in a child process: rank `rank` of `tp`'s packed read and swap alone."""
    import torch

    from pagedllm.distributed import parallel_state
    from pagedllm.model.layers.packed_swap import require_kernels
    from pagedllm.model.loader import ModelSource, load_hf_config
    from pagedllm.model.quantization.registry import quantization_config
    from pagedllm.model.registry import resolve_model_class
    from pagedllm.ops.attention_registry import get_attention_backend
    from pagedllm.ops.kernel_selection import select_kernels
    from pagedllm.runner.model_building import KEEP_PACKED_WEIGHTS

    group = parallel_state.GroupCoordinator(list(range(tp)), rank, torch.device("cpu"))
    parallel_state._TP = group  # a stand-in: building and swapping call no collective
    hf_config = load_hf_config(ModelSource(str(directory), False))
    cpu = torch.device("cpu")
    kernels = select_kernels(
        cpu, torch.float32, "torch", head_dim=SHAPE.head_dim, cache_dtype=torch.float32
    )
    backend = get_attention_backend(kernels.attention)
    model_class = resolve_model_class(hf_config.architectures)
    model = model_class(hf_config, backend, torch.float32, 256, kernels=kernels)
    config = quantization_config(hf_config)
    method = config["quant_method"]
    require_kernels(method)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here on
    before = _status_mb("VmRSS:")
    KEEP_PACKED_WEIGHTS[method](model, str(directory), config)
    return {"before": before, "peak": _status_mb("VmHWM:"), "after": _status_mb("VmRSS:")}


def swap_peaks(directory: Path, tp: int) -> list[dict]:
    peaks = []
    for rank in range(tp):
        command = [sys.executable, "-m", "benchmarks.packed_load_memory", "--child-rank"]
        command += [str(rank), "--tp", str(tp), "--child-dir", str(directory)]
        finished = subprocess.run(command, capture_output=True, text=True, check=True)
        peaks.append(json.loads(finished.stdout.strip().splitlines()[-1]))
    return peaks


def packed_bytes(directory: Path) -> int:
    """The checkpoint's bytes in its layers' files (the packed projections and the norms)."""
    return sum(f.stat().st_size for f in directory.glob("model-layer-*.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", default="gptq-4bit-g128", choices=sorted(FORMATS))
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--child-rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--child-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_dir:
        print(json.dumps(swap_child(Path(args.child_dir), args.child_rank, args.tp)))
        return
    directory = checkpoint(args.format)
    swap = swap_peaks(directory, args.tp)
    from pagedllm import LLM

    llm = LLM(
        str(directory), max_model_len=256, kv_cache_memory="16MiB", skip_tokenizer_init=True,
        max_num_batched_tokens=64, max_num_seqs=4,  # a small first step: loading's peak
        tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp,
    )  # fmt: skip
    peaks = rank_peaks(args.tp, args.pp)
    result = {
        "format": args.format,
        "shape": SHAPE.name,
        "tp": args.tp,
        "pp": args.pp,
        "checkpoint_layer_files_gb": round(packed_bytes(directory) / 1e9, 3),
        "swap_peak_rss_mb": swap,
        "engine_rank_peak_rss_gb": [round(peak / 1e9, 3) for peak in peaks],
    }
    print(json.dumps(result))
    if args.tp * args.pp > 1:
        llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
