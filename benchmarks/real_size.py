"""Real-size models on their GGUF blocks: load, memory, single-stream decode and 32 streams.

For each `--shapes` (Llama-3.2-1B, Llama-3.1-8B) a random-weight Q4_K_M file of that shape
(`benchmarks.random_gguf`, written once into the peers' cache) is run by pagedllm with
`--quantization gguf` and, where llama.cpp is built (`--llama-cpp`), by llama.cpp:

- pagedllm's load: seconds from `LLM(...)` to ready, and the process's resident memory then
  (in a child process of its own), against the file's size and the KV pool;
- single-stream decode tokens/s: pagedllm generates from a 1-token prompt, decode rate =
  the tokens after the first over their time; llama.cpp `llama-bench -p 0 -n N` (`tgN`);
- `--batched S,P,N` (32,128,64): S distinct prompts of P tokens with N output tokens each,
  offline and all at once, against `llama-batched-bench -npp P -ntg N -npl S` (whole time);
- `--prefill-tokens N` (512): one N-token prompt's tokens/s against `llama-bench -p N` (ppN);
- the bandwidth bound of single-stream decode: the weights' bytes read per token divided by
  this machine's read bandwidth (measured here: torch sums a 2 GiB tensor on all threads);
- `--concurrency` (32) concurrent requests through each engine's OpenAI server
  (`pagedllm serve`, `llama-server -np 32`): prompts of `--prompt-sentences` sentences (~16
  tokens each), `--concurrent-output` tokens each, output tokens/s over the wall time of
  the batch.

`--gguf` runs given files (a real model's, e.g. Gemma 3 270M's Q4_K_M) in place of the
random shapes. pagedllm's decode steps compile where its engine compiles them by default
(its load time then includes the compile); `--compile` / `--no-compile` ask for one or the
other (the engine's and the server's flags).

    .venv/bin/python -m benchmarks.real_size [--shapes llama-3.2-1b,llama-3.1-8b]
        [--gguf FILE,...] [--decode-tokens 64] [--batched 32,128,64] [--prefill-tokens 512]
        [--concurrent-output 64] [--concurrency 32] [--gguf-activation-bits 16|8]
        [--[no-]compile] [--llama-cpp DIR] [--output-json F]

Prints one JSON object per shape; record the CPU's flags beside it (`lscpu`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
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


def pagedllm_child(
    path: str,
    decode_tokens: int,
    kv_gib: float,
    batched: dict | None,
    prefill_tokens: int,
    activation_bits: int = 16,
    compile_decode: bool | None = None,
) -> dict:
    """Runs in its own process: load, resident memory, single-stream decode, and where asked
    the batched run and the prefill rate."""
    from pagedllm import LLM

    started = time.perf_counter()
    llm = LLM(
        model=path, quantization="gguf", gguf_activation_bits=activation_bits,
        max_model_len=1024, kv_cache_memory=f"{kv_gib}GiB", compile=compile_decode,
    )  # fmt: skip
    load_s = time.perf_counter() - started
    rss = _rss_bytes()
    model = llm.model_runner.model
    weights = sum(t.nbytes for t in {t.data_ptr(): t for t in model.buffers()}.values())
    return {
        "compile": llm.model_runner.compiled_decode is not None,  # what the engine chose
        **_memory_and_decode(load_s, rss, weights, single_stream_decode_rate(llm, decode_tokens)),
        **({"batched": batched_run(llm, **batched)} if batched else {}),
        **({"prefill_tok_s": prefill_rate(llm, prefill_tokens)} if prefill_tokens else {}),
    }


def single_stream_decode_rate(llm, decode_tokens: int) -> float:
    """Tokens/s of one request decoding greedily from a 1-token prompt, after a warm-up; the
    first token (the prefill) is timed apart and taken out."""
    from pagedllm import SamplingParams

    prompt = [{"prompt_token_ids": [1000]}]

    def run(tokens: int) -> float:
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompt, params, use_tqdm=False)
        return time.perf_counter() - start

    run(4)  # warm-up
    first, whole = run(1), run(decode_tokens + 1)
    return decode_tokens / (whole - first)


def _memory_and_decode(load_s: float, rss: int, weights: int, decode_tok_s: float) -> dict:
    return {
        "load_s": round(load_s, 1),
        "rss_after_load_gb": round(rss / 1e9, 3),
        "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9, 3),
        "weight_buffers_gb": round(weights / 1e9, 3),
        "decode_tok_s": round(decode_tok_s, 2),
    }


def _random_prompts(count: int, length: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(1000, 30000) for _ in range(length)]}
            for _ in range(count)]  # fmt: skip


def batched_run(llm, sequences: int, prompt_tokens: int, output_tokens: int) -> dict:
    """`llama-batched-bench -npp P -ntg N -npl S`'s work: S distinct prompts of P tokens, N
    output tokens each, all at once; the whole wall time."""
    from pagedllm import SamplingParams

    params = SamplingParams(max_tokens=output_tokens, temperature=0, ignore_eos=True)
    prompts = _random_prompts(sequences, prompt_tokens, seed=1)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    return {
        "sequences": sequences, "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
        "seconds": round(wall, 2), "output_tok_s": round(sequences * output_tokens / wall, 2),
    }  # fmt: skip


def prefill_rate(llm, prompt_tokens: int) -> float:
    """Prompt tokens/s of one prompt and its first token (`llama-bench -p N`'s `ppN`): the
    best of two prompts (distinct, so no prefix is cached)."""
    from pagedllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0)
    best = float("inf")
    for seed in (2, 3):
        prompt = _random_prompts(1, prompt_tokens, seed)
        start = time.perf_counter()
        llm.generate(prompt, params, use_tqdm=False)
        best = min(best, time.perf_counter() - start)
    return round(prompt_tokens / best, 2)


def compile_flags(compile_decode: bool | None) -> list[str]:
    """pagedllm's flags for a compiled decode step, an eager one, or the engine's choice."""
    return {True: ["--compile"], False: ["--no-compile"], None: []}[compile_decode]


def run_pagedllm(path: Path, args: argparse.Namespace) -> dict:
    command = [sys.executable, "-m", "benchmarks.real_size", "--child", str(path)]
    command += ["--decode-tokens", str(args.decode_tokens), "--kv-gib", str(args.kv_gib)]
    command += ["--batched", args.batched, "--prefill-tokens", str(args.prefill_tokens)]
    command += ["--gguf-activation-bits", str(args.gguf_activation_bits)]
    command += compile_flags(args.compile)
    output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(output.strip().splitlines()[-1])


def llama_bench(binary: Path, path: Path, prompt_tokens: int, decode_tokens: int) -> float:
    """`llama-bench`'s tokens/s for one test: `-p 0 -n N` (tgN) or `-p N -n 0` (ppN)."""
    command = [str(binary), "-m", str(path), "-p", str(prompt_tokens), "-n", str(decode_tokens)]
    command += ["-t", "2", "-r", "2", "-o", "json"]
    output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return round(json.loads(output)[0]["avg_ts"], 2)


def parse_batched(spec: str) -> dict | None:
    """`--batched S,P,N` (sequences, prompt tokens, output tokens); "" or "0" for none."""
    if spec in ("", "0"):
        return None
    sequences, prompt_tokens, output_tokens = (int(part) for part in spec.split(","))
    return {"sequences": sequences, "prompt_tokens": prompt_tokens, "output_tokens": output_tokens}


def llama_batched_bench(binary: Path, path: Path, batched: dict) -> dict:
    """`llama-batched-bench -npp P -ntg N -npl S`: the whole time, output tokens/s over it."""
    sequences, prompt_tokens = batched["sequences"], batched["prompt_tokens"]
    output_tokens = batched["output_tokens"]
    context = sequences * (prompt_tokens + output_tokens)
    command = [str(binary), "-m", str(path), "-c", str(context), "-b", "2048", "-ub", "512",
               "-npp", str(prompt_tokens), "-ntg", str(output_tokens), "-npl", str(sequences),
               "-t", "2", "--output-format", "jsonl"]  # fmt: skip
    output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    row = json.loads(next(line for line in output.splitlines() if line.startswith("{")))
    return {
        "seconds": round(row["t"], 2), "prompt_seconds": round(row["t_pp"], 2),
        "output_tok_s": round(sequences * output_tokens / row["t"], 2),
    }  # fmt: skip


def concurrent_output_rate(
    base_url: str, prompt: str, output_tokens: int, concurrency: int
) -> dict:
    """`concurrency` completions at once; output tokens/s over the batch's wall time. Each
    prompt starts with its own number, so no engine serves one from another's cached
    prefix."""
    counts: list[int] = []

    def one(number: int) -> None:
        body = json.dumps(
            {"model": "model", "prompt": f"{number}. {prompt}", "max_tokens": output_tokens,
             "temperature": 0, "ignore_eos": True}
        ).encode()  # fmt: skip
        request = urllib.request.Request(
            base_url + "/v1/completions", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=3600) as reply:
            counts.append(json.load(reply)["usage"]["completion_tokens"])

    threads = [threading.Thread(target=one, args=(n,)) for n in range(concurrency)]
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
        concurrent_output_rate(server.base_url, "Warm up. " + prompt, 2, concurrency=1)
        return concurrent_output_rate(
            server.base_url, prompt, args.concurrent_output, args.concurrency
        )
    finally:
        server.stop()


def measure_file(shape: str, path: Path, args: argparse.Namespace, bandwidth: float) -> dict:
    paths = PeerPaths()
    result = {"shape": shape, "file_gb": round(path.stat().st_size / 1e9, 3)}
    ours = result["pagedllm"] = run_pagedllm(path, args)
    result["bandwidth_bound_tok_s"] = round(bandwidth / ours["weight_buffers_gb"], 2)
    llama_bin = Path(args.llama_cpp) if args.llama_cpp else paths.llama_build / "bin"
    if (llama_bin / "llama-bench").exists():
        bench = llama_bin / "llama-bench"
        result["llama_cpp_tg_tok_s"] = llama_bench(bench, path, 0, args.decode_tokens)
        result["decode_vs_llama_cpp"] = round(
            ours["decode_tok_s"] / result["llama_cpp_tg_tok_s"], 3
        )
        if args.prefill_tokens:
            result["llama_cpp_pp_tok_s"] = llama_bench(bench, path, args.prefill_tokens, 0)
            result["prefill_vs_llama_cpp"] = round(
                ours["prefill_tok_s"] / result["llama_cpp_pp_tok_s"], 3
            )
    batched = parse_batched(args.batched)
    if batched and (llama_bin / "llama-batched-bench").exists():
        theirs = llama_batched_bench(llama_bin / "llama-batched-bench", path, batched)
        result["llama_cpp_batched"] = theirs
        # Both do the same work, so the ratio of whole times is the speed-up.
        result["batched_vs_llama_cpp"] = round(theirs["seconds"] / ours["batched"]["seconds"], 3)
    if args.concurrent_output:
        log_dir = Path(args.log_dir)
        port = free_port()
        ours = [sys.executable, "-m", "pagedllm", "serve", "--model", str(path), "--host",
                "127.0.0.1", "--port", str(port), "--quantization", "gguf",
                "--served-model-name", "model", "--max-model-len", "1024",
                "--kv-cache-memory", f"{args.kv_gib}GiB",
                "--gguf-activation-bits", str(args.gguf_activation_bits)]  # fmt: skip
        ours += compile_flags(args.compile)
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
    parser.add_argument(
        "--batched", default="32,128,64",
        help="offline S,P,N: S sequences of P prompt and N output tokens at once (0: skip)",
    )  # fmt: skip
    parser.add_argument(
        "--prefill-tokens", type=int, default=512, help="one prompt's length for ppN (0: skip)"
    )
    parser.add_argument(
        "--gguf-activation-bits", type=int, default=16, choices=[16, 8],
        help="pagedllm's activation precision (8: one int8 digit, llama.cpp's)",
    )  # fmt: skip
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        help="pagedllm's compiled decode step, or not (default: the engine's choice)",
    )
    parser.add_argument("--llama-cpp", help="llama.cpp's bin/ (default: the peers' build)")
    parser.add_argument("--log-dir", default="benchmarks/out/real_size")
    parser.add_argument("--output-json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child = pagedllm_child(
            args.child, args.decode_tokens, args.kv_gib, parse_batched(args.batched),
            args.prefill_tokens, args.gguf_activation_bits, args.compile,
        )  # fmt: skip
        print(json.dumps(child))
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
