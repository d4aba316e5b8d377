"""Real-size models on their GGUF blocks: load, memory, single-stream decode and 32 streams.

For each `--shapes` (Llama-3.2-1B, Llama-3.1-8B) a random-weight Q4_K_M file of that shape
(`benchmarks.random_gguf`, written once into the peers' cache) is run by pagedllm with
`--quantization gguf` and, where llama.cpp is built (`--llama-cpp`), by llama.cpp:

- pagedllm's load: seconds from `LLM(...)` to ready, and the process's resident memory then
  (in a child process of its own), against the file's size and the KV pool;
- single-stream decode tokens/s: pagedllm generates from a 1-token prompt, decode rate =
  the tokens after the first over their time; llama.cpp `llama-bench -p 0 -n N` (`tgN`);
- the bandwidth bound of single-stream decode: the weights' bytes read per token divided by
  this machine's read bandwidth (measured here: torch sums a 2 GiB tensor on all threads);
- `--concurrency` (32) concurrent requests through each engine's OpenAI server
  (`pagedllm serve`, `llama-server -np 32`): prompts of `--prompt-sentences` sentences (~16
  tokens each), `--concurrent-output` tokens each, output tokens/s over the wall time of
  the batch.

`--gguf` runs given files (a real model's, e.g. Gemma 3 270M's Q4_K_M) in place of the
random shapes.

    .venv/bin/python -m benchmarks.real_size [--shapes llama-3.2-1b,llama-3.1-8b]
        [--gguf FILE,...] [--decode-tokens 64] [--concurrent-output 64] [--concurrency 32]
        [--llama-cpp DIR] [--output-json F]

Prints one JSON object per shape; record the CPU's flags beside it (`lscpu`).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from benchmarks.peers.common import PeerPaths
from benchmarks.peers.servers import start_server
from benchmarks.random_gguf import FILE_TYPES, SHAPES, write_random_gguf
from pagedllm.utils import free_port

CONCURRENCY = 32
SENTENCE = "The history of the city begins with a small settlement by the river, and "


def model_file(shape: str, root: Path) -> Path:
    """The shape's random Q4_K_M file, written on first use."""
    path = root / "models" / f"random-{shape}-q4_k_m.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        write_random_gguf(partial, SHAPES[shape], FILE_TYPES["Q4_K_M"], progress=True)
        partial.rename(path)
    return path


def read_bandwidth_gb_s() -> float:
    """This machine's read bandwidth: the best of five sums of a 2 GiB fp32 tensor."""
    import torch

    data = torch.ones(2**29)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.nbytes / best / 1e9


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) * 1024
    return -1


def pagedllm_child(path: str, decode_tokens: int, kv_gib: float) -> dict:
    """Runs in its own process: load, resident memory, single-stream decode."""
    from pagedllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(model=path, quantization="gguf", max_model_len=1024, kv_cache_memory=f"{kv_gib}GiB")
    load_s = time.perf_counter() - started
    rss = _rss_bytes()
    model = llm.llm_engine.engine_core.model_executor.driver_worker.model_runner.model
    weights = sum(t.nbytes for t in {t.data_ptr(): t for t in model.buffers()}.values())
    prompt = [{"prompt_token_ids": [1000]}]

    def run(tokens: int) -> float:
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompt, params, use_tqdm=False)
        return time.perf_counter() - start

    run(4)  # warm-up
    first, whole = run(1), run(decode_tokens + 1)
    return {
        "load_s": round(load_s, 1),
        "rss_after_load_gb": round(rss / 1e9, 3),
        "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9, 3),
        "weight_buffers_gb": round(weights / 1e9, 3),
        "decode_tok_s": round(decode_tokens / (whole - first), 2),
    }


def run_pagedllm(path: Path, decode_tokens: int, kv_gib: float) -> dict:
    command = [sys.executable, "-m", "benchmarks.real_size", "--child", str(path)]
    command += ["--decode-tokens", str(decode_tokens), "--kv-gib", str(kv_gib)]
    output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(output.strip().splitlines()[-1])


def llama_bench(binary: Path, path: Path, decode_tokens: int) -> float:
    command = [str(binary), "-m", str(path), "-p", "0", "-n", str(decode_tokens), "-t", "2"]
    command += ["-r", "2", "-o", "json"]
    output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return round(json.loads(output)[0]["avg_ts"], 2)


def concurrent_output_rate(
    base_url: str, prompt: str, output_tokens: int, concurrency: int
) -> dict:
    """`concurrency` completions at once; output tokens/s over the batch's wall time."""
    body = json.dumps(
        {"model": "model", "prompt": prompt, "max_tokens": output_tokens, "temperature": 0,
         "ignore_eos": True}
    ).encode()  # fmt: skip
    counts: list[int] = []

    def one() -> None:
        request = urllib.request.Request(
            base_url + "/v1/completions", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=3600) as reply:
            counts.append(json.load(reply)["usage"]["completion_tokens"])

    threads = [threading.Thread(target=one) for _ in range(concurrency)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    return {"completed": len(counts), "output_tok_s": round(sum(counts) / wall, 2)}


def serve_and_measure(
    name: str, command: list[str], port: int, args: argparse.Namespace, log: Path
):
    server = start_server(name, command, port, log)
    prompt = SENTENCE * args.prompt_sentences
    try:
        concurrent_output_rate(server.base_url, prompt, 2, concurrency=1)  # warm-up
        return concurrent_output_rate(
            server.base_url, prompt, args.concurrent_output, args.concurrency
        )
    finally:
        server.stop()


def measure_file(shape: str, path: Path, args: argparse.Namespace, bandwidth: float) -> dict:
    paths = PeerPaths()
    result = {"shape": shape, "file_gb": round(path.stat().st_size / 1e9, 3)}
    result["pagedllm"] = run_pagedllm(path, args.decode_tokens, args.kv_gib)
    weights = result["pagedllm"]["weight_buffers_gb"]
    result["bandwidth_bound_tok_s"] = round(bandwidth / weights, 2)
    llama_bin = Path(args.llama_cpp) if args.llama_cpp else paths.llama_build / "bin"
    if (llama_bin / "llama-bench").exists():
        result["llama_cpp_tg_tok_s"] = llama_bench(
            llama_bin / "llama-bench", path, args.decode_tokens
        )
        result["decode_vs_llama_cpp"] = round(
            result["pagedllm"]["decode_tok_s"] / result["llama_cpp_tg_tok_s"], 3
        )
    if args.concurrent_output:
        log_dir = Path(args.log_dir)
        port = free_port()
        ours = [sys.executable, "-m", "pagedllm", "serve", "--model", str(path), "--host",
                "127.0.0.1", "--port", str(port), "--quantization", "gguf",
                "--served-model-name", "model", "--max-model-len", "1024",
                "--kv-cache-memory", f"{args.kv_gib}GiB"]  # fmt: skip
        result["pagedllm_concurrent"] = serve_and_measure(
            "pagedllm", ours, port, args, log_dir / f"pagedllm-{shape}.log"
        )
        if (llama_bin / "llama-server").exists():
            port = free_port()
            theirs = [str(llama_bin / "llama-server"), "-m", str(path), "--host", "127.0.0.1",
                      "--port", str(port), "-np", str(args.concurrency), "-c",
                      str(args.concurrency * 512), "-t", "2", "-a", "model"]  # fmt: skip
            result["llama_cpp_concurrent"] = serve_and_measure(
                "llama.cpp", theirs, port, args, log_dir / f"llama-{shape}.log"
            )
            result["concurrent_vs_llama_cpp"] = round(
                result["pagedllm_concurrent"]["output_tok_s"]
                / result["llama_cpp_concurrent"]["output_tok_s"],
                3,
            )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="llama-3.2-1b,llama-3.1-8b")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--gguf", help="comma-separated GGUF files to run instead of --shapes")
    parser.add_argument("--concurrent-output", type=int, default=64, help="0: skip")
    parser.add_argument("--concurrency", type=int, default=CONCURRENCY, help="requests at once")
    parser.add_argument("--prompt-sentences", type=int, default=8, help="~16 tokens each")
    parser.add_argument("--kv-gib", type=float, default=2.0)
    parser.add_argument("--llama-cpp", help="llama.cpp's bin/ (default: the peers' build)")
    parser.add_argument("--log-dir", default="benchmarks/out/real_size")
    parser.add_argument("--output-json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(pagedllm_child(args.child, args.decode_tokens, args.kv_gib)))
        return
    bandwidth = read_bandwidth_gb_s()
    print(json.dumps({"read_bandwidth_gb_s": round(bandwidth, 1), "cpus": os.cpu_count()}))
    results = []
    files = (
        [(Path(f).stem, Path(f)) for f in args.gguf.split(",")]
        if args.gguf
        else [(shape, model_file(shape, PeerPaths().root)) for shape in args.shapes.split(",")]
    )
    for name, path in files:
        results.append(measure_file(name, path, args, bandwidth))
        print(json.dumps(results[-1]), flush=True)
    if args.output_json:
        with open(args.output_json, "w") as out:
            json.dump({"read_bandwidth_gb_s": round(bandwidth, 1), "runs": results}, out, indent=2)


if __name__ == "__main__":
    main()
