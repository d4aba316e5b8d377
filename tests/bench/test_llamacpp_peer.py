"""The llama.cpp peer's build flags: native, but without b11434's AMX path on AMX-INT8 CPUs
(its prompt processing dies there), naming each extension the CPU has instead."""

from __future__ import annotations

from benchmarks.peers.llamacpp import COMMON_FLAGS, cmake_flags

SAPPHIRE_RAPIDS = {
    "avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512vl", "avx512vbmi",
    "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8",
}  # fmt: skip


def test_a_cpu_without_amx_int8_builds_native():
    assert cmake_flags({"avx", "avx2", "fma", "avx512f", "avx512_vnni"}) == [
        "-DGGML_NATIVE=ON",
        *COMMON_FLAGS,
    ]
    # AMX-BF16 alone does not turn on ggml's AMX path (it needs AMX-INT8).
    assert cmake_flags({"avx2", "amx_tile", "amx_bf16"})[0] == "-DGGML_NATIVE=ON"


def test_an_amx_int8_cpu_names_its_other_extensions_and_not_native():
    flags = cmake_flags(SAPPHIRE_RAPIDS)
    assert flags[0] == "-DGGML_NATIVE=OFF"
    assert flags[-len(COMMON_FLAGS) :] == COMMON_FLAGS
    on = {f.removeprefix("-D").removesuffix("=ON") for f in flags if f.endswith("=ON")}
    assert on == {
        "GGML_AVX", "GGML_AVX2", "GGML_FMA", "GGML_F16C", "GGML_BMI2", "GGML_AVX512",
        "GGML_AVX512_VBMI", "GGML_AVX512_VNNI", "GGML_AVX512_BF16", "GGML_AVX_VNNI",
    }  # fmt: skip
    assert not any("AMX" in f for f in flags)


def test_an_extension_the_cpu_lacks_is_off():
    flags = cmake_flags(SAPPHIRE_RAPIDS - {"avx512_bf16", "avx_vnni"})
    assert "-DGGML_AVX512_BF16=OFF" in flags and "-DGGML_AVX_VNNI=OFF" in flags
    assert "-DGGML_AVX512_VNNI=ON" in flags
