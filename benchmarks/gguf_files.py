"""Writing GGUF files of random or tiny models, as llama.cpp's converter lays them out: the
pieces the GGUF benchmarks and the GGUF tests (tests/gguf_writer.py) both write with."""

from __future__ import annotations

from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q


def add_model_shape(writer: gguf.GGUFWriter, config: Any, name: str) -> None:
    """The name and the shape keys every architecture's file carries (a Hugging Face
    config's context length, widths, layer and head counts)."""
    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)


def add_tensor(writer: gguf.GGUFWriter, name: str, array: np.ndarray, qtype: Q) -> None:
    """`array` quantized to `qtype` (F32 and F16 stored as plain arrays, others as blocks)."""
    data = gguf.quants.quantize(array.astype(np.float32), qtype)
    if qtype in (Q.F32, Q.F16):
        writer.add_tensor(name, data)
    else:
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)


def finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
