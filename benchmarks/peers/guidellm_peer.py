"""GuideLLM as a load generator: its virtualenv and its `benchmark` command line.

Install (once, stamped): a virtualenv under the cache root, `torch==2.13.0+cpu` first (GuideLLM
depends on torch; unconstrained, pip would pull a CUDA build), then `guidellm==0.8.1`
constrained to that torch. GuideLLM makes its synthetic prompts with a tokenizer: it gets a
local directory (`pagedllm export-tokenizer`), never a hub name, and runs with
`HF_HUB_OFFLINE=1`.
"""

from __future__ import annotations

import time
from pathlib import Path

from benchmarks.peers.common import PeerPaths, Runner, read_stamp, write_stamp
from benchmarks.peers.torch_venv import import_check_versions, install_torch_venv

GUIDELLM_REQUIREMENT = "guidellm==0.8.1"
STEP = "guidellm-venv"
GUIDELLM_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def guidellm_python(paths: PeerPaths) -> Path:
    return paths.guidellm_venv / "bin" / "python"


def install(paths: PeerPaths, runner: Runner) -> dict:
    """Creates and fills the virtualenv unless its stamp says it is done; returns the stamp."""
    done = read_stamp(paths, STEP)
    if done:
        return done
    started = time.monotonic()
    install_torch_venv(paths, runner, "guidellm", paths.guidellm_venv, GUIDELLM_REQUIREMENT)
    if runner.dry_run:
        return {}
    versions = installed_versions(paths, runner)
    write_stamp(paths, STEP, time.monotonic() - started, **versions)
    return read_stamp(paths, STEP) or {}


def installed_versions(paths: PeerPaths, runner: Runner) -> dict[str, str]:
    """guidellm's and torch's versions, read after importing guidellm (the import works)."""
    script = (
        "import importlib.metadata as m, json, guidellm; "
        "print(json.dumps({'guidellm': m.version('guidellm'), 'torch': m.version('torch')}))"
    )
    python = guidellm_python(paths)
    return import_check_versions(paths, runner, "guidellm", python, script, env=GUIDELLM_ENV)


def run_command(
    paths: PeerPaths, base_url: str, model: str, tokenizer: Path, profile: str,
    max_requests: int, input_len: int, output_len: int, out_json: Path,
) -> list[str]:  # fmt: skip
    """`guidellm run` on synthetic prompts of `input_len` tokens, `output_len` out (EOS
    ignored, as GuideLLM asks for whenever the data fixes the output length), chat endpoint,
    streaming. `profile` is GuideLLM's: "kind=synchronous", "kind=concurrent,streams=8"."""
    return [
        str(paths.guidellm_venv / "bin" / "guidellm"), "run",
        "--backend", f"kind=openai_http,target={base_url},model={model}",
        "--profile", profile,
        "--constraint", f"kind=max_requests,count={max_requests}",
        "--data", f"kind=synthetic_text,prompt_tokens={input_len},output_tokens={output_len}",
        "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
        "--output", f"kind=json,path={out_json}",
        "--disable-console-interactive",
    ]  # fmt: skip
