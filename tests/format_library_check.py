"""A one-off check, not a test: the test writers' AWQ and compressed-tensors pack-quantized
tensors (tests/awq_writer.py, tests/ct_writer.py) unpacked by the format libraries' own
code equal pagedllm's readers' dequantization, in the library's dtype.

Neither library is a project dependency (AutoAWQ needs a GPU to quantize; compressed-tensors
pulls loguru in, for a format pagedllm reads without it), so this runs against their sources
fetched by hand:

    pip download autoawq==0.2.9 compressed-tensors==0.20.1 --no-deps -d /tmp/fmt
    (unpack both; pip install loguru into a throwaway venv)
    AUTOAWQ_SRC=/tmp/fmt/autoawq-0.2.9 PYTHONPATH=/tmp/fmt/ct:<venv>/site-packages:.:tests \\
        .venv/bin/python tests/format_library_check.py

Done on 2026-11-29 with AutoAWQ 0.2.9 and compressed-tensors 0.20.1: every case equal.
"""

from __future__ import annotations

import importlib.util
import os

import torch
from awq_writer import AWQScheme, quantize_awq
from ct_writer import CTScheme, quantize_packed

from pagedllm.model.quantization.awq import AWQConfig
from pagedllm.model.quantization.awq_format import AWQTensors, unpack_awq
from pagedllm.model.quantization.ct_pack_format import PackedTensors, unpack_pack_quantized
from pagedllm.model.quantization.ct_pack_quantized import packed_scheme

OUTPUTS, INPUTS = 96, 512


def _autoawq_packing_utils():
    """AutoAWQ's awq/utils/packing_utils.py alone (it imports only torch)."""
    path = os.path.join(os.environ["AUTOAWQ_SRC"], "awq", "utils", "packing_utils.py")
    spec = importlib.util.spec_from_file_location("awq_packing_utils", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_awq(weight: torch.Tensor) -> bool:
    packing_utils = _autoawq_packing_utils()
    same = True
    for scheme in (AWQScheme(128), AWQScheme(32), AWQScheme(-1)):
        tensors = quantize_awq(weight, scheme)
        config = AWQConfig.from_dict(scheme.quantization_config())
        ours = unpack_awq(AWQTensors(**tensors), config).dequantize()
        group_size = INPUTS if scheme.group_size == -1 else scheme.group_size
        theirs = packing_utils.dequantize_gemm(
            tensors["qweight"], tensors["qzeros"], tensors["scales"], 4, group_size
        ).T  # fp16 [N, K]
        equal = torch.equal(ours.to(theirs.dtype), theirs)
        print(f"{scheme}: AutoAWQ's dequantize_gemm equal: {equal}")
        same &= equal
    return same


def check_compressed_tensors(weight: torch.Tensor) -> bool:
    from compressed_tensors.compressors.pack_quantized.base import (
        PackedQuantizationCompressor,
    )
    from compressed_tensors.quantization import QuantizationScheme

    same = True
    for scheme in (
        CTScheme(4, 128, True), CTScheme(4, 32, False), CTScheme(4, -1, False),
        CTScheme(8, -1, True), CTScheme(8, 128, False),
    ):  # fmt: skip
        tensors = quantize_packed(weight, scheme, torch.Generator().manual_seed(0))
        group = scheme.quantization_config()["config_groups"]["group_0"]
        ours = unpack_pack_quantized(PackedTensors(**tensors), packed_scheme(group))
        library_scheme = QuantizationScheme(targets=["Linear"], weights=group["weights"])
        theirs = PackedQuantizationCompressor.decompress(dict(tensors), library_scheme)["weight"]
        equal = torch.equal(ours.dequantize().to(theirs.dtype), theirs)
        print(f"{scheme}: compressed-tensors' decompress equal: {equal} ({theirs.dtype})")
        same &= equal
    return same


def main() -> None:
    weight = torch.randn(OUTPUTS, INPUTS, generator=torch.Generator().manual_seed(0))
    same = check_awq(weight) & check_compressed_tensors(weight)
    print("every case equal" if same else "DIFFERENT")
    raise SystemExit(0 if same else 1)


if __name__ == "__main__":
    main()
