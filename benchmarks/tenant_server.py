"""A `pagedllm serve` with two tenants (two API keys from a keys file), for the benchmarks that
send traffic as more than one tenant (`fair_share`, `rate_sweep`, `soak`), and the word
prompts they send."""

from __future__ import annotations

import json
import random
from pathlib import Path

from benchmarks.peers.common import OUR_BIN
from benchmarks.peers.servers import Server, start_server
from pagedllm.utils import free_port

# Common English words, one token each in BPE vocabularies: N words are about N tokens.
WORDS = ("the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by")


def prompt_text(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def start_tenant_server(name: str, keys: dict[str, str], out_dir: Path, flags: list[str]) -> Server:
    """Starts the server on a free port with `keys` (tenant name → key) and `flags`; its log
    is `out_dir/<name>.log`. Returns once /health answers."""
    out_dir.mkdir(parents=True, exist_ok=True)
    keys_file = out_dir / f"{name}-api-keys.txt"
    keys_file.write_text("".join(f"{tenant} {key}\n" for tenant, key in keys.items()))
    port = free_port()
    command = [
        str(OUR_BIN / "pagedllm"), "serve", "--host", "127.0.0.1", "--port", str(port),
        "--api-keys-file", str(keys_file), "--disable-uvicorn-access-log", "--disable-log-stats",
        *flags,
    ]  # fmt: skip
    return start_server(name, command, port, out_dir / f"{name}.log")


def report_policies(args, measure, out_dir: Path) -> int:
    """Runs `measure(policy, args, out_dir)` for each of `args.policies` and prints (and, with
    `--output-json`, writes) the report: the arguments and each policy's result."""
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {"config": vars(args), "policies": [measure(p, args, out_dir) for p in args.policies]}
    text = json.dumps(report, indent=2)
    print(text)
    if args.output_json:
        Path(args.output_json).write_text(text + "\n")
    return 0
