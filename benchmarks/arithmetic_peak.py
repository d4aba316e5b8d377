"""The cores' own arithmetic peak: what no matmul, ours or any engine's, can pass.

Builds a small C program (gcc, OpenMP) and runs register-only loops on every core at once:

  clock       a chain of dependent integer adds (one a cycle) gives the cycles per second
  fp32 FMA    12 independent FMA chains on 256- and 512-bit vectors: FLOP per cycle and s
  int8 AVX2   12 independent vpmaddubsw (u8 x s8 pairs into int16, no accumulate): the
              AVX2 path's multiplies, MACs per cycle (its adds and widening come on top)
  int8 VNNI   12 independent vpdpbusd chains (u8 x s8 pairs into int32): MACs per cycle
  bf16 dot    12 independent vdpbf16ps chains (bf16 pairs into fp32, AVX512-BF16): FLOP
              per cycle, two products and two adds per fp32 lane
  int8 AMX    4 independent tdpbsud on full tiles (16 x 64 bytes, s8 x u8 into int32,
              AMX-INT8 where Linux grants the tiles): MACs per cycle

No memory is touched inside the loops, so these are the cores' issue rates, the bound above
`ceiling.py`'s measured matmul rate. Each thread is timed by its own CPU time: on cores
shared with other work a rate is per second the loop actually ran. `--json PATH` writes the figures.

    .venv/bin/python -m benchmarks.arithmetic_peak [--seconds 1] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

_SOURCE = r"""
#include <cpuid.h>
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* The calling thread's own CPU time: a loop's rate is per second it ran, so other processes
   sharing the cores (time slices, a hypervisor's steal) do not bend the per-cycle ratios. */
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

/* 64 dependent register adds an iteration: one a cycle on every x86 core since the
   Pentium 4. Register, not immediate, operands: Intel cores from Golden Cove on fold chains
   of immediate adds in the renamer and retire several a cycle (15 "GHz" seen). */
static void add_chain(long iterations) {
    long x = 0, one = 1;
    for (long i = 0; i < iterations; i++) {
        __asm__ volatile(
            ".rept 64\n\tadd %1, %0\n\t.endr" : "+r"(x) : "r"(one));
    }
}

/* 12 independent chains on zeroed registers, written in asm so that no compiler keeps
   them in memory: the FMA's latency (4 cycles) times two pipes needs 8 in flight. */
#define CHAINS 12
#define ZERO \
    ".irp r,0,1,2,3,4,5,6,7,8,9,10,11,12,13\n\tvxorps %%xmm\\r,%%xmm\\r,%%xmm\\r\n\t.endr\n\t"
#define LOOP(W, INSN)                                                                  \
    __asm__ volatile(ZERO "1:\n\t.irp r,0,1,2,3,4,5,6,7,8,9,10,11\n\t" INSN " %%" W \
                     "12,%%" W "13,%%" W "\\r\n\t.endr\n\tdec %0\n\tjnz 1b"                \
                     : "+r"(iterations)                                                \
                     :                                                                 \
                     : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7",  \
                       "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "cc");

__attribute__((target("avx2,fma"))) static void fma256(long iterations) {
    LOOP("ymm", "vfmadd231ps")
}
__attribute__((target("avx512f"))) static void fma512(long iterations) {
    LOOP("zmm", "vfmadd231ps")
}
__attribute__((target("avx2"))) static void maddubs256(long iterations) {
    LOOP("ymm", "vpmaddubsw")
}
__attribute__((target("avx512f,avx512vl,avx512vnni"))) static void vnni256(long iterations) {
    LOOP("ymm", "vpdpbusd")
}
__attribute__((target("avx512f,avx512vnni"))) static void vnni512(long iterations) {
    LOOP("zmm", "vpdpbusd")
}

__attribute__((target("avx512f,avx512vl,avx512bf16"))) static void bf16dot256(long iterations) {
    LOOP("ymm", "vdpbf16ps")
}
__attribute__((target("avx512f,avx512bf16"))) static void bf16dot512(long iterations) {
    LOOP("zmm", "vdpbf16ps")
}

/* AMX-INT8 (CPUID leaf 7, EDX bit 25), and Linux's grant of the tile data. */
static int amx_int8_granted(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 25))) return 0;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
}

struct tile_config {
    unsigned char palette, start_row, reserved[14];
    unsigned short colsb[16];
    unsigned char rows[16];
} __attribute__((aligned(64)));

/* Four independent multiplies of full tiles an iteration: C0..C3 += A4|A5 x B6|B7. */
__attribute__((target("amx-tile,amx-int8"))) static void amx_int8(long iterations) {
    struct tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; t++) {
        config.rows[t] = 16;
        config.colsb[t] = 64;
    }
    __asm__ volatile("" : : "r"(&config) : "memory"); /* GCC 12 drops the stores as dead */
    _tile_loadconfig(&config);
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (long i = 0; i < iterations; i++) {
        _tile_dpbsud(0, 4, 6);
        _tile_dpbsud(1, 4, 7);
        _tile_dpbsud(2, 5, 6);
        _tile_dpbsud(3, 5, 7);
    }
    _tile_release();
}

typedef void (*loop_fn)(long);

/* Every thread runs `fn` for about `seconds`; prints the iterations a second of all threads
   together. One call is sized to >= 50 ms first, on one thread. */
static void run(const char *name, loop_fn fn, double seconds, double ops_per_iteration) {
    long iterations = 1000;
    double took = 0;
    while (took < 0.05) {
        iterations *= 4;
        double started = now();
        fn(iterations);
        took = now() - started;
    }
    long calls = (long)(seconds / took) + 1;
    double total_rate = 0;
    #pragma omp parallel reduction(+ : total_rate)
    {
        double t0 = now();
        for (long k = 0; k < calls; k++) fn(iterations);
        total_rate = calls * iterations / (now() - t0);
    }
    printf("%s %.6e %.6e\n", name, total_rate, ops_per_iteration);
}

int main(int argc, char **argv) {
    double seconds = argc > 1 ? atof(argv[1]) : 1.0;
    run("clock", add_chain, seconds, 64);
    run("fp32_fma_256", fma256, seconds, CHAINS * 8 * 2);
    if (__builtin_cpu_supports("avx512f"))
        run("fp32_fma_512", fma512, seconds, CHAINS * 16 * 2);
    if (__builtin_cpu_supports("avx2"))
        run("int8_avx2_256", maddubs256, seconds, CHAINS * 32);
    if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl")) {
        run("int8_vnni_256", vnni256, seconds, CHAINS * 32);
        run("int8_vnni_512", vnni512, seconds, CHAINS * 64);
    }
    if (__builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vl")) {
        run("bf16_dot_256", bf16dot256, seconds, CHAINS * 8 * 4);
        run("bf16_dot_512", bf16dot512, seconds, CHAINS * 16 * 4);
    }
    if (amx_int8_granted()) run("int8_amx_tile", amx_int8, seconds, 4 * 16 * 16 * 64);
    return 0;
}
"""


def build(directory: Path) -> Path:
    source, binary = directory / "peak.c", directory / "peak"
    source.write_text(_SOURCE)
    subprocess.run(["gcc", "-O3", "-fopenmp", str(source), "-o", str(binary)], check=True)
    return binary


def measure(seconds: float, threads: int) -> dict[str, dict[str, float]]:
    """{loop: {"per_second": ops a second on all threads, "per_cycle_per_core": ...}}."""
    with tempfile.TemporaryDirectory() as directory:
        binary = build(Path(directory))
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "OMP_PROC_BIND": "spread"}
        output = subprocess.run(
            [str(binary), str(seconds)], check=True, capture_output=True, text=True, env=env
        ).stdout
    rates = {}
    for line in output.splitlines():
        name, iterations_per_s, ops_per_iteration = line.split()
        rates[name] = float(iterations_per_s) * float(ops_per_iteration)
    cycles_per_s = rates["clock"]  # add-chain ops a second, all threads = cycles a second
    return {
        name: {"per_second": rate, "per_cycle_per_core": rate / cycles_per_s}
        for name, rate in rates.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=1.0, help="per loop, per thread")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    figures = measure(args.seconds, args.threads)
    clock_ghz = figures["clock"]["per_second"] / args.threads / 1e9
    print(f"{args.threads} threads, {clock_ghz:.2f} GHz per core (dependent adds)")
    for name, figure in figures.items():
        if name == "clock":
            continue
        unit = "G int8 MAC/s" if name.startswith("int8") else "GFLOP/s"
        print(
            f"{name:14s} {figure['per_second'] / 1e9:8.1f} {unit:13s}"
            f" {figure['per_cycle_per_core']:6.1f} a cycle a core"
        )
    if args.json:
        args.json.write_text(json.dumps({"threads": args.threads, **figures}, indent=2) + "\n")


if __name__ == "__main__":
    main()
