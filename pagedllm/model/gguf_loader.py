"""Reading llama.cpp GGUF checkpoints into the Hugging Face view of a model.

The entry point to everything that is specific to the GGUF file format (the work is done
in `pagedllm.model.gguf`, one job a module):

* ``load_gguf_config`` turns the GGUF metadata into a ``transformers`` config
  (Llama, Mistral, Mixtral, Qwen2, Qwen3, Qwen3-MoE, Phi-3 or Gemma 3 text) that the
  model code can build a network from (`gguf.config`, `gguf.family_config`);
* ``load_gguf_tokenizer`` builds the tokenizer stored in the file, chat template
  included (`gguf.tokenizer`);
* ``iter_gguf_weights`` streams every tensor, dequantized to float32 and renamed,
  reshaped, (for Llama-family files) un-permuted, (for Gemma 3) its norm weights
  shifted back by one and (for mixtures of experts) each layer's gate and up experts
  stacked in one tensor, so that it equals the tensor Transformers holds; and
  ``iter_gguf_raw_weights`` yields the 2-D weights in their blocks, for layers that
  compute on them (``iter_gguf_raw_experts``: a mixture's stacked experts, each
  expert's slice of the blocks) (`gguf.weights`, named by `gguf.tensor_names` from
  gguf-py's tables);
* ``release_gguf_readers`` forgets the parsed files once the weights are loaded
  (`gguf.reader`).

Architectures llama.cpp writes under names of its own: Mistral and Mixtral are ``llama``
files (Mixtral told apart by its experts, Mistral by its name); Phi-3 keeps its fused q/k/v
and gate/up tensors and its LongRoPE factors as tensors. Other architectures are refused,
naming the supported ones (``SUPPORTED_GGUF_ARCHITECTURES``).

It does not build models, place weights on devices or pick dtypes: callers own
that. Files that are not valid GGUF raise ``ValueError("<path>: not a valid GGUF
file: ...")``; tensors these modules cannot map or decode raise ``ValueError``
naming the tensor.
"""

from __future__ import annotations

from pagedllm.model.gguf.config import SUPPORTED_GGUF_ARCHITECTURES, load_gguf_config
from pagedllm.model.gguf.reader import SUPPORTED_TENSOR_TYPES, release_gguf_readers
from pagedllm.model.gguf.tokenizer import load_gguf_tokenizer
from pagedllm.model.gguf.weights import (
    iter_gguf_raw_experts,
    iter_gguf_raw_weights,
    iter_gguf_weights,
)

__all__ = [
    "SUPPORTED_GGUF_ARCHITECTURES",
    "SUPPORTED_TENSOR_TYPES",
    "iter_gguf_raw_experts",
    "iter_gguf_raw_weights",
    "iter_gguf_weights",
    "load_gguf_config",
    "load_gguf_tokenizer",
    "release_gguf_readers",
]
