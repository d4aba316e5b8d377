"""The platform wheel (issue 46): `pip wheel .` compiles the C++ kernels ahead of time, and
the wheel installed into a fresh virtualenv, with no compiler on PATH, runs a greedy
generation on them, compiling nothing.

Building the wheel compiles every kernel (minutes on two cores), so a built wheel is kept
in pagedllm's cache (`wheels/<digest>`, beside the JIT builds: never in the repository),
named by a digest of everything it packages; a changed file builds a new one. It is built
without build isolation, against this virtualenv's torch: the pinned one the build
environment would install, without copying it again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from model_utils import make_tiny_model
from process_guard import dies_with_us

from pagedllm import LLM, SamplingParams
from pagedllm.ops import extension
from pagedllm.utils import cache_root

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

REPO = Path(__file__).resolve().parents[2]
# What the wheel is built from (setup.py and pyproject.toml name the rest).
BUILD_INPUTS = ("pyproject.toml", "setup.py", "README.md", "pagedllm")
COMPILERS = ("cc", "c++", "gcc", "g++", "clang", "clang++")
PROMPT = [5, 77, 301, 12, 9, 140, 33]
MAX_TOKENS = 12

# Run in the fresh virtualenv: one greedy generation, then where the kernels came from.
GENERATE = """
import json, sys
from pagedllm import LLM, SamplingParams
from pagedllm.ops import extension
from pagedllm.ops.cpu_attention import CpuAttentionBackend

llm = LLM(sys.argv[1], max_model_len=64)
runner = llm.llm_engine.engine_core.model_executor.driver_worker.model_runner
model = runner.model
backends = {type(m.backend) for m in model.modules() if hasattr(m, "backend")}
params = SamplingParams(temperature=0, max_tokens=int(sys.argv[3]), ignore_eos=True)
prompt = {"prompt_token_ids": json.loads(sys.argv[2])}
tokens = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
print(json.dumps({
    "tokens": list(tokens),
    "cpu_attention": backends == {CpuAttentionBackend},
    "library": str(extension.loaded_from()),
    "package": extension.__file__,
    "compiled": runner.compiled_decode is not None,
}))
"""


def _files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted(
        p
        for p in path.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".so", ".pyc")
    )


def _inputs() -> list[Path]:
    return [file for name in BUILD_INPUTS for file in _files(REPO / name)]


def _digest(files: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in files:
        digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def _run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(
        command, capture_output=True, text=True, preexec_fn=dies_with_us(), **kwargs
    )
    assert result.returncode == 0, f"{command} failed:\n{result.stdout}\n{result.stderr}"
    return result


def _store(folder: Path, cached: Path) -> None:
    """`folder` copied to `cached` whole or not at all (runs may race; the first one wins)."""
    staged = cached.parent / f".{cached.name}.{os.getpid()}"
    shutil.copytree(folder, staged)  # beside its place: a rename does not cross file systems
    try:
        os.replace(staged, cached)
    except OSError:
        if not cached.is_dir():
            raise
        shutil.rmtree(staged)


def built_wheel(scratch: Path) -> Path:
    """The wheel of this checkout, from the cache or built now (from a copy of the sources,
    so the build's own files stay out of the checkout)."""
    files = _inputs()
    cached = cache_root() / "wheels" / _digest(files)
    if not cached.is_dir():
        source = scratch / "source"
        for path in files:
            target = source / path.relative_to(REPO)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
        out = scratch / "wheel"
        pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
        _run([*pip, "--wheel-dir", str(out), str(source)])
        _store(out, cached)
    (wheel,) = cached.glob("pagedllm-*.whl")
    return wheel


def fresh_venv(scratch: Path, wheel: Path) -> Path:
    """A virtualenv holding the wheel and its declared dependencies, at the locked versions."""
    venv = scratch / "venv"
    # Filled by this interpreter's pip (`--python`): a pip of its own would be one more
    # package to install, which the test never runs.
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    pip = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install"]
    # No byte-compiling: thousands of files (transformers', torch's, sympy's), most never
    # imported by the one run that follows; what it imports is compiled as it loads.
    pip += ["--quiet", "--no-compile"]
    # Outside the checkout and without its PYTHONPATH: pip would take the checkout's
    # metadata (an egg-info a pip run left there) for pagedllm installed already.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    _run([*pip, "-c", str(REPO / "constraints.txt"), str(wheel)], env=env, cwd=scratch)
    return venv


def no_compiler_env(venv: Path, scratch: Path) -> dict[str, str]:
    """The environment of a user without a compiler: PATH is the virtualenv's bin alone,
    and the engine decides whether to compile its decode step (the suite's PAGEDLLM_COMPILE
    dropped)."""
    dropped = ("CC", "CXX", "PYTHONPATH", "PAGEDLLM_COMPILE")
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    env["PATH"] = str(venv / "bin")
    env["PAGEDLLM_CACHE_DIR"] = str(scratch / "cache")  # empty: a JIT build would land here
    env["TORCH_EXTENSIONS_DIR"] = str(scratch / "torch-extensions")
    for compiler in COMPILERS:
        assert shutil.which(compiler, path=env["PATH"]) is None, compiler
    return env


@pytest.fixture
def scratch() -> Iterator[Path]:
    """A folder of this test's own, not under pytest's basetemp: pytest sessions started
    meanwhile (other checkouts') delete all but the latest three basetemps, and this test
    runs for minutes."""
    with tempfile.TemporaryDirectory(prefix="pagedllm-wheel-") as folder:
        yield Path(folder)


def test_the_wheel_runs_its_prebuilt_kernels_without_a_compiler(scratch):
    model = make_tiny_model("LlamaForCausalLM", scratch / "model")
    wheel = built_wheel(scratch)
    venv = fresh_venv(scratch, wheel)
    env = no_compiler_env(venv, scratch)
    python = str(venv / "bin" / "python")
    command = [python, "-c", GENERATE, str(model), json.dumps(PROMPT), str(MAX_TOKENS)]
    # Not from the checkout: its pagedllm would be imported instead of the installed one.
    result = _run(command, env=env, cwd=scratch)
    report = json.loads(result.stdout.strip().splitlines()[-1])

    site_packages = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    assert Path(report["package"]).is_relative_to(site_packages)
    library = Path(report["library"])
    assert library.parent == site_packages / "site-packages" / "pagedllm" / "ops"
    assert library.name.startswith("_pagedllm_cpu_ops_"), library  # the wheel's, not a JIT one
    assert report["cpu_attention"]
    assert not (scratch / "cache" / "extensions").exists()  # nothing compiled
    assert not (scratch / "torch-extensions").exists()
    # Inductor's code would need a compiler too: the default leaves the step eager, and says so.
    assert not report["compiled"]
    assert "Decode steps run eagerly: no C++ compiler" in result.stderr

    # The same tokens as this checkout's kernels give.
    llm = LLM(str(model), max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    assert report["tokens"] == list(expected[0].outputs[0].token_ids)
    assert extension.loaded_from() is not None
