"""Opening a GGUF file and reading its metadata and tensors.

This module owns the parsed `GGUFReader` of a file (parsed once per file version, dropped
by `release_gguf_readers`), typed access to its metadata keys, and the decoding of one
tensor to float32 in the shape Transformers gives it, refusing types this project does
not support. Files that are not valid GGUF raise ``ValueError("<path>: not a valid GGUF
file: ...")``.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, ReaderField, ReaderTensor
from gguf.quants import dequantize

from pagedllm.model.gguf.tensor_table import GGUFTensor

_T = GGMLQuantizationType
# An explicit list (rather than "whatever gguf-py can decode") so that an
# unsupported file is rejected before any tensor is dequantized.
SUPPORTED_TENSOR_TYPES: frozenset[GGMLQuantizationType] = frozenset(
    {
        _T.F32, _T.F16, _T.BF16,
        _T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q5_1, _T.Q8_0,
        _T.Q2_K, _T.Q3_K, _T.Q4_K, _T.Q5_K, _T.Q6_K,
    }
)  # fmt: skip

_READER_ERRORS = (ValueError, IndexError, KeyError, TypeError, OverflowError, UnicodeDecodeError)


def open_gguf(path: str) -> GGUFReader:
    """Parse the header, metadata and tensor table of ``path`` (once per file version)."""
    stat = os.stat(path)
    return _open_gguf_cached(os.path.abspath(path), stat.st_mtime_ns, stat.st_size)


def release_gguf_readers() -> None:
    """Forget the parsed files: once the weights are loaded, nothing should keep a file
    mapped (its touched pages would count in the process's resident size)."""
    _open_gguf_cached.cache_clear()


@functools.lru_cache(maxsize=2)
def _open_gguf_cached(path: str, mtime_ns: int, size: int) -> GGUFReader:
    # Parsing walks every tokenizer string (~3.5 s for a 49k vocabulary); config,
    # weights and tokenizer all need the same reader, so it is parsed once.
    try:
        # gguf-py reads eagerly and without bounds checks: bad magic, truncation
        # or garbage counts surface as one of these errors from inside the reader.
        return GGUFReader(path)
    except _READER_ERRORS as exc:
        raise ValueError(f"{path}: not a valid GGUF file: {exc}") from exc


def _field_value(field: ReaderField) -> Any:
    value = field.contents()
    # GGUF stores hyper-parameters such as 1e-5 as float32; going through the
    # float32's shortest repr gives back the decimal the HF config had.
    if field.types == [GGUFValueType.FLOAT32]:
        return float(str(np.float32(value)))
    return value


def get_value(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """The value of metadata key `key`, `default` where the file has none."""
    field = reader.get_field(key)
    return default if field is None else _field_value(field)


def require_value(reader: GGUFReader, key: str, path: str) -> Any:
    """The value of metadata key `key`; a file without it is refused."""
    field = reader.get_field(key)
    if field is None:
        raise ValueError(f"{path}: missing GGUF metadata key {key!r}")
    return _field_value(field)


def require_int(reader: GGUFReader, key: str, path: str) -> int:
    """`require_value` as an int; a per-layer list is accepted only if all its values agree."""
    value = require_value(reader, key, path)
    if isinstance(value, list):
        # Some converters write per-layer lists; this engine needs uniform layers.
        if not value or any(v != value[0] for v in value):
            raise ValueError(f"{path}: per-layer values for {key!r} are not supported: {value}")
        value = value[0]
    return int(value)


def hf_shape(tensor: ReaderTensor | GGUFTensor) -> tuple[int, ...]:
    """The tensor's shape as torch (and Transformers) gives it."""
    # GGUF lists dimensions fastest-varying first, i.e. reversed from torch.
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def check_tensor_type(tensor: ReaderTensor | GGUFTensor, path: str) -> None:
    """Refuse a tensor whose type is not in `SUPPORTED_TENSOR_TYPES`."""
    if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES:
        raise ValueError(
            f"{path}: tensor {tensor.name!r} has unsupported type {tensor.tensor_type.name}"
        )


def dequantize_tensor(tensor: ReaderTensor | GGUFTensor, path: str) -> torch.Tensor:
    """The tensor as float32, shaped as in the Hugging Face checkpoint."""
    check_tensor_type(tensor, path)
    array = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    array = array.reshape(hf_shape(tensor))
    if not array.flags.writeable:
        # F32 tensors come back as views of the read-only memmap; torch needs
        # memory it may write, and the mapping must not outlive the reader.
        array = array.copy()
    return torch.from_numpy(array)
