"""A GGUF file's tensor table, read without parsing its metadata's arrays.

`gguf.GGUFReader` builds a numpy view for every value of every metadata array: a Llama-3
vocabulary (128,256 tokens and 280,147 merges) takes it 5-10 s on this project's CPUs,
before any weight is touched. Loading weights needs only the tensor table, so this reader
walks the header once, stepping over array values (strings by their lengths, never
decoded), and maps the file: the
tensors it returns have `GGUFReader`'s fields (`name`, `tensor_type`, `shape` in GGUF order,
`data` as the same numpy views of the mapping), so the loader treats both alike.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import quant_shape_to_byte_shape

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# Fixed-size metadata value types (GGUFValueType) -> struct format.
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9
_PLAIN_DTYPES = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray  # GGUF order: fastest-varying dimension first
    data: np.ndarray  # a read-only view of the mapped file
    data_offset: int  # where `data` starts in the file


class _Cursor:
    def __init__(self, buffer: np.memmap) -> None:
        self.buffer, self.pos = buffer, 0

    def unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from("<" + fmt, self.buffer, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return values

    def string(self) -> str:
        (length,) = self.unpack("Q")
        self.pos += length
        return bytes(self.buffer[self.pos - length : self.pos]).decode("utf-8")

    def skip_string(self) -> None:
        (length,) = self.unpack("Q")
        self.pos += length

    def value(self, value_type: int) -> object:
        """A scalar or string value; arrays are skipped (None)."""
        if value_type in _SCALARS:
            return self.unpack(_SCALARS[value_type])[0]
        if value_type == _STRING:
            return self.string()
        if value_type != _ARRAY:
            raise ValueError(f"unknown GGUF value type {value_type}")
        element_type, count = self.unpack("IQ")
        if element_type in _SCALARS:
            self.pos += count * struct.calcsize("<" + _SCALARS[element_type])
        elif element_type == _STRING:  # the vocabulary: stepped over, never decoded
            for _ in range(count):
                self.skip_string()
        else:
            for _ in range(count):
                self.value(element_type)
        return None


def read_gguf_tensors(path: str) -> tuple[list[GGUFTensor], dict[str, object]]:
    """(tensors, the metadata's scalar and string values) of the GGUF file at `path`.
    Raises ValueError ("not a valid GGUF file") for anything else or a file cut short."""
    with open(path, "rb") as file:
        if file.read(4) != _MAGIC:
            raise ValueError(f"{path}: not a valid GGUF file: bad magic")
    buffer = np.memmap(path, mode="r", dtype=np.uint8)
    cursor = _Cursor(buffer)
    try:
        (version,) = cursor.unpack("4xI")
        if version not in (2, 3):
            raise ValueError(f"{path}: not a valid GGUF file: not GGUF v2/v3")
        n_tensors, n_kv = cursor.unpack("QQ")
        metadata = {}
        for _ in range(n_kv):
            key = cursor.string()
            (value_type,) = cursor.unpack("I")
            value = cursor.value(value_type)
            if value is not None:
                metadata[key] = value
        infos = []
        for _ in range(n_tensors):
            name = cursor.string()
            (n_dims,) = cursor.unpack("I")
            dims = cursor.unpack("Q" * n_dims)
            raw_type, offset = cursor.unpack("IQ")
            infos.append((name, np.array(dims, dtype=np.uint64), raw_type, offset))
    except (struct.error, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: not a valid GGUF file: header cut short ({error})") from error
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    start = -(-cursor.pos // alignment) * alignment
    return [_tensor(buffer, start, *info, path) for info in infos], metadata


def _tensor(
    buffer: np.memmap,
    start: int,
    name: str,
    dims: np.ndarray,
    raw_type: int,
    offset: int,
    path: str,
) -> GGUFTensor:
    ggml_type = GGMLQuantizationType(raw_type)
    n_elements = int(np.prod(dims))
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    n_bytes = n_elements * type_size // block_size
    begin = start + offset
    if begin + n_bytes > len(buffer):
        raise ValueError(f"{path}: not a valid GGUF file: tensor {name!r} runs past its end")
    np_dims = tuple(reversed(dims.tolist()))
    data = buffer[begin : begin + n_bytes]
    if ggml_type in _PLAIN_DTYPES:
        data = data.view(_PLAIN_DTYPES[ggml_type]).reshape(np_dims)
    else:
        data = data.reshape(quant_shape_to_byte_shape(np_dims, ggml_type))
    return GGUFTensor(name, ggml_type, dims, data, begin)
