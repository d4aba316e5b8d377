"""Every quantized checkpoint format pagedllm serves, on one random-weight Llama shape, in one
sitting: memory held against the checkpoint, load, decode speed and its bandwidth bound.

Formats (`--formats`, default all): GPTQ, AWQ and compressed-tensors W4A16 (4-bit, group
128), compressed-tensors W8A8 int8 and FP8 dynamic, FP8 in 128 x 128 blocks, GGUF Q4_K_M,
and the dense model (bf16 where the CPU has AVX512-BF16 or AMX, else fp32). Each checkpoint
is written once outside the repository (`benchmarks.quantized_checkpoints`) and loaded in a
child process of its own, which reports:

- the weight bytes held after load against the checkpoint's tensor bytes (and their ratio),
  the process's resident memory, the load seconds;
- with `--decode-tokens N` > 0: single-stream decode tokens/s (N greedy tokens from a
  1-token prompt) and `--concurrency` (32) sequences decoding N tokens each at once from
  16-token prompts (offline, output tokens/s over the whole time);
- the bandwidth bound of single-stream decode: the weight bytes held (each read once a
  token; the shapes tie the head to the embedding) over this machine's read bandwidth.

llama.cpp runs the Q4_K_M file where it is built (`llama-bench` tgN, `llama-batched-bench`).
`--decode-tokens 0` measures memory only. `--dummy` loads the packed formats (GPTQ, AWQ,
W4A16) from a config.json alone with `load_format="dummy"`: no checkpoint is written, the
memory is the same layers' (their stored bytes computed from one layer's tensors). The CPU's
flags and the load average are recorded with the results.

    .venv/bin/python -m benchmarks.quantized_real_size --shape llama-3.2-1b
        [--formats gptq-g128 ...] [--decode-tokens 64] [--concurrency 32] [--dummy]
        [--output-json F]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.peers.common import PeerPaths
from benchmarks.quantized_checkpoints import (
    DENSE,
    FORMATS,
    GGUF,
    PACKED,
    checkpoint_path,
    checkpoint_tensor_bytes,
    cpu_flags,
    dense_format,
    held_projection_bytes,
    held_weight_bytes,
    packed_tensor_bytes,
    write_checkpoint,
    write_packed_config,
)
from benchmarks.random_gguf import SHAPES
from benchmarks.real_size import (
    _rss_bytes,
    batched_run,
    llama_batched_bench,
    llama_bench,
    read_bandwidth_gb_s,
    single_stream_decode_rate,
)
from pagedllm.utils import cache_root

CONCURRENCY = 32
CONCURRENT_PROMPT_TOKENS = 16
RECORDED_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16",
                  "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16")  # fmt: skip


def engine_options(path: str, fmt: str) -> dict:
    """How `LLM` opens `fmt`'s checkpoint: GGUF named, the dense row on dummy weights."""
    if fmt == GGUF:
        return {"quantization": "gguf"}
    if fmt in DENSE:
        return {"load_format": "dummy", "dtype": "bfloat16" if fmt == "bf16" else "float32"}
    if fmt in PACKED and not any(Path(path).glob("*.safetensors")):  # --dummy: a config
        return {"load_format": "dummy"}
    return {}


def child(path: str, fmt: str, decode_tokens: int, concurrency: int) -> dict:
    """Runs in its own process: load, memory held, and where asked the decode rates."""
    from pagedllm import LLM

    started = time.perf_counter()
    llm = LLM(
        model=path, max_model_len=1024, kv_cache_memory="1GiB", skip_tokenizer_init=True,
        **engine_options(path, fmt),
    )  # fmt: skip
    result = {
        "load_s": round(time.perf_counter() - started, 1),
        "rss_after_load_bytes": _rss_bytes(),
        "held_weight_bytes": held_weight_bytes(llm.model_runner.model),
        "held_projection_bytes": held_projection_bytes(llm.model_runner.model),
    }
    if decode_tokens:
        result["decode_tok_s"] = round(single_stream_decode_rate(llm, decode_tokens), 2)
    if decode_tokens and concurrency:
        batch = batched_run(llm, concurrency, CONCURRENT_PROMPT_TOKENS, decode_tokens)
        result["concurrent"] = batch
    return result


def run_child(path: Path, fmt: str, args: argparse.Namespace) -> dict:
    command = [sys.executable, "-m", "benchmarks.quantized_real_size", "--child", str(path)]
    command += ["--child-format", fmt, "--decode-tokens", str(args.decode_tokens)]
    command += ["--concurrency", str(args.concurrency)]
    finished = subprocess.run(command, capture_output=True, text=True)
    if finished.returncode != 0:
        raise RuntimeError(f"{fmt}'s child failed:\n{finished.stderr[-3000:]}")
    return json.loads(finished.stdout.strip().splitlines()[-1])


def measure_format(shape_name: str, fmt: str, args: argparse.Namespace, bandwidth: float) -> dict:
    shape = SHAPES[shape_name]
    root = PeerPaths().root / "models" if fmt == GGUF else cache_root() / "models"
    if args.dummy and fmt in PACKED:
        path = checkpoint_path(root, shape_name, fmt).with_name(f"config-{shape_name}-{fmt}")
        path, stored = write_packed_config(path, shape, fmt), packed_tensor_bytes(shape, fmt)
    else:
        path = write_checkpoint(checkpoint_path(root, shape_name, fmt), shape, fmt)
        stored = checkpoint_tensor_bytes(path, shape, fmt)
    result = {
        "checkpoint_tensor_bytes": stored["all"],
        "checkpoint_projection_bytes": stored["projections"],
        **run_child(path, fmt, args),
    }
    held = result["held_weight_bytes"]
    result["held_over_checkpoint"] = round(held / stored["all"], 3)
    result["projections_held_over_checkpoint"] = round(
        result["held_projection_bytes"] / stored["projections"], 3
    )
    if bandwidth:
        result["bandwidth_bound_tok_s"] = round(bandwidth * 1e9 / held, 2)
    return result


def llama_cpp_rows(path: Path, args: argparse.Namespace) -> dict:
    """llama.cpp on the Q4_K_M file, where it is built: tgN and the concurrent batch."""
    binaries = Path(args.llama_cpp) if args.llama_cpp else PeerPaths().llama_build / "bin"
    if not (binaries / "llama-bench").exists() or not args.decode_tokens:
        return {}
    rows = {"decode_tok_s": llama_bench(binaries / "llama-bench", path, 0, args.decode_tokens)}
    if args.concurrency and (binaries / "llama-batched-bench").exists():
        batch = {"sequences": args.concurrency, "prompt_tokens": CONCURRENT_PROMPT_TOKENS,
                 "output_tokens": args.decode_tokens}  # fmt: skip
        rows["concurrent"] = llama_batched_bench(binaries / "llama-batched-bench", path, batch)
    return rows


def sitting(flags: set[str]) -> dict:
    """What the results are read against: the CPU's flags and the machine's load."""
    return {
        "cpu_flags": [flag for flag in RECORDED_FLAGS if flag in flags],
        "cpus": os.cpu_count(),
        "load_average_before": [round(load, 2) for load in os.getloadavg()],
    }


def default_formats(flags: set[str]) -> list[str]:
    return [fmt for fmt in FORMATS if fmt not in DENSE] + [dense_format(flags)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    parser.add_argument("--formats", nargs="+", choices=FORMATS, help="default: all, one dense")
    parser.add_argument("--decode-tokens", type=int, default=64, help="0: memory only")
    parser.add_argument("--concurrency", type=int, default=CONCURRENCY, help="0: skip")
    parser.add_argument("--llama-cpp", help="llama.cpp's bin/ (default: the peers' build)")
    parser.add_argument(
        "--dummy", action="store_true", help="packed formats: a config.json, no checkpoint"
    )
    parser.add_argument("--output-json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-format", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.child_format, args.decode_tokens,
                               args.concurrency)))  # fmt: skip
        return
    flags = cpu_flags()
    results = {"shape": args.shape, "dummy_packed": args.dummy, **sitting(flags), "formats": {}}
    bandwidth = read_bandwidth_gb_s() if args.decode_tokens else 0.0
    results["read_bandwidth_gb_s"] = round(bandwidth, 1)
    for fmt in args.formats or default_formats(flags):
        results["formats"][fmt] = measure_format(args.shape, fmt, args, bandwidth)
        print(json.dumps({fmt: results["formats"][fmt]}), flush=True)
    if GGUF in results["formats"]:
        gguf_path = checkpoint_path(PeerPaths().root / "models", args.shape, GGUF)
        results["llama_cpp_q4_k_m"] = llama_cpp_rows(gguf_path, args)
    results["load_average_after"] = [round(load, 2) for load in os.getloadavg()]
    print(json.dumps(results))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
