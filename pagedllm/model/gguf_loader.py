"""Reading llama.cpp GGUF checkpoints into the Hugging Face view of a model.

This module owns everything that is specific to the GGUF file format:

* ``load_gguf_config`` turns the GGUF metadata into a ``transformers`` config
  (Llama, Mistral or Qwen2) that the model code can build a network from;
* ``load_gguf_tokenizer`` builds the tokenizer stored in the file, chat template
  included;
* ``iter_gguf_weights`` streams every tensor, dequantized to float32 and renamed,
  reshaped and (for Llama-family files) un-permuted so that it equals the tensor
  of the original Hugging Face checkpoint.

It does not build models, place weights on devices or pick dtypes: callers own
that. Files that are not valid GGUF raise ``ValueError("<path>: not a valid GGUF
file: ...")``; tensors this module cannot map or decode raise ``ValueError``
naming the tensor.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import os
import re
import shutil
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, ReaderField, ReaderTensor
from gguf.quants import dequantize
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, AutoTokenizer, PreTrainedConfig, PreTrainedTokenizerBase

from pagedllm.model.gguf_tensors import GGUFTensor, read_gguf_tensors
from pagedllm.utils import cache_root

__all__ = ["iter_gguf_weights", "load_gguf_config", "load_gguf_tokenizer"]

logger = logging.getLogger(__name__)

_T = GGMLQuantizationType
# Bump when the conversion changes, so cached tokenizers are rebuilt.
_TOKENIZER_CACHE_VERSION = "1"
_CONFIG_CACHE_VERSION = "1"
_WEIGHTS_CACHE_VERSION = "1"
# Small files load fast anyway; caching their weights would only fill the disk.
_MIN_WEIGHTS_CACHE_BYTES = 32 * 1024 * 1024
# An explicit list (rather than "whatever gguf-py can decode") so that an
# unsupported file is rejected before any tensor is dequantized.
SUPPORTED_TENSOR_TYPES: frozenset[GGMLQuantizationType] = frozenset(
    {
        _T.F32, _T.F16, _T.BF16,
        _T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q5_1, _T.Q8_0,
        _T.Q2_K, _T.Q3_K, _T.Q4_K, _T.Q5_K, _T.Q6_K,
    }
)  # fmt: skip

# GGUF architecture -> (HF model_type, HF architecture class name).
_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("mistral", "MistralForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
}

# llama.cpp's HF->GGUF converter interleaves the rotary halves of q/k rows for
# these architectures (to match its GPT-J style rope); Qwen2 is stored as is.
_PERMUTED_ARCHITECTURES = frozenset({"llama", "mistral"})

_GLOBAL_TENSORS: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_TENSORS: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_TENSOR_RE = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")
_GLOBAL_TENSOR_RE = re.compile(r"([a-z_]+)\.(weight|bias)")
# Not parameters of the HF model: their content is folded into the config.
_CONFIG_ONLY_TENSORS = frozenset({"rope_freqs.weight"})

# Where llama.cpp's converter assumes a llama3 model was pre-trained when the
# HF config does not say (convert_hf_to_gguf.py, LlamaModel).
_LLAMA3_DEFAULT_ORIGINAL_CONTEXT = 8192

_READER_ERRORS = (ValueError, IndexError, KeyError, TypeError, OverflowError, UnicodeDecodeError)


# --------------------------------------------------------------------------- reading


def _open_gguf(path: str) -> GGUFReader:
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


def _get(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    return default if field is None else _field_value(field)


def _require(reader: GGUFReader, key: str, path: str) -> Any:
    field = reader.get_field(key)
    if field is None:
        raise ValueError(f"{path}: missing GGUF metadata key {key!r}")
    return _field_value(field)


def _require_int(reader: GGUFReader, key: str, path: str) -> int:
    value = _require(reader, key, path)
    if isinstance(value, list):
        # Some converters write per-layer lists; this engine needs uniform layers.
        if not value or any(v != value[0] for v in value):
            raise ValueError(f"{path}: per-layer values for {key!r} are not supported: {value}")
        value = value[0]
    return int(value)


# --------------------------------------------------------------------------- config


def _model_type(reader: GGUFReader, arch: str, path: str) -> tuple[str, str]:
    if arch not in _ARCHITECTURES:
        raise ValueError(f"{path}: unsupported GGUF architecture {arch!r}")
    if arch == "llama":
        # llama.cpp writes Mistral checkpoints with the llama architecture; only
        # the model's name tells them apart.
        names = (_get(reader, "general.name", ""), _get(reader, "general.basename", ""))
        if any("mistral" in str(name).lower() for name in names):
            return _ARCHITECTURES["mistral"]
    return _ARCHITECTURES[arch]


def _hf_shape(tensor: ReaderTensor | GGUFTensor) -> tuple[int, ...]:
    # GGUF lists dimensions fastest-varying first, i.e. reversed from torch.
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def _head_dim(
    reader: GGUFReader, prefix: str, tensors: dict[str, ReaderTensor], hidden: int, heads: int
) -> int:
    key_length = _get(reader, f"{prefix}attention.key_length")
    if key_length is not None:
        return int(key_length)
    q_proj = tensors.get("blk.0.attn_q.weight")
    if q_proj is not None:
        return _hf_shape(q_proj)[0] // heads
    return hidden // heads


def _vocab_size(
    reader: GGUFReader, prefix: str, tensors: dict[str, ReaderTensor], path: str
) -> int:
    vocab = _get(reader, f"{prefix}vocab_size")
    if vocab is not None:
        return int(vocab)
    # Older converters omit <arch>.vocab_size; the embedding matrix is authoritative.
    if "token_embd.weight" in tensors:
        return _hf_shape(tensors["token_embd.weight"])[0]
    tokens = reader.get_field("tokenizer.ggml.tokens")
    if tokens is not None:
        return len(tokens.data)
    raise ValueError(f"{path}: cannot determine vocab_size (no metadata, no token_embd.weight)")


def _llama3_factors(theta: float, head_dim: int, params: dict[str, float]) -> np.ndarray:
    """The per-frequency divisors llama.cpp stores in ``rope_freqs.weight``."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    old_ctx = params["original_max_position_embeddings"]
    low, high, factor = params["low_freq_factor"], params["high_freq_factor"], params["factor"]
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = 1.0 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen > old_ctx / low, factor, smoothed)
    return np.where(wavelen < old_ctx / high, 1.0, out)


def _llama3_rope(
    factors: np.ndarray, theta: float, head_dim: int, old_ctx: int, path: str
) -> dict[str, Any] | None:
    """Recover HF's llama3 rope parameters from llama.cpp's precomputed factors."""
    factor = float(factors.max())
    if factor <= 1.0 + 1e-6:
        return None
    params: dict[str, Any] = {
        "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": old_ctx,
    }  # fmt: skip
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    x = old_ctx * freqs / (2 * math.pi)  # == old_ctx / wavelen
    ramp = (factors > 1.0 + 1e-4) & (factors < factor - 1e-4)
    if int(ramp.sum()) >= 2:
        # In the ramp, 1/f = (1 - s)/factor + s with s = (x - low) / (high - low),
        # i.e. s is linear in x; a line fit gives both ramp ends.
        s = (1.0 / factors[ramp] - 1.0 / factor) / (1.0 - 1.0 / factor)
        slope, intercept = np.polyfit(x[ramp], s, 1)
        params["low_freq_factor"] = round(float(-intercept / slope), 4)
        params["high_freq_factor"] = round(float((1.0 - intercept) / slope), 4)
    expected = _llama3_factors(theta, head_dim, params)
    if not np.allclose(expected, factors, rtol=1e-3, atol=1e-3):
        logger.warning(
            "%s: rope_freqs.weight is not reproduced by llama3 rope parameters %s", path, params
        )
    return {"rope_type": "llama3", **params}


def _rope_parameters(
    reader: GGUFReader, prefix: str, tensors: dict[str, ReaderTensor], head_dim: int, path: str
) -> dict[str, Any]:
    # transformers 5 keeps the rope base inside rope_parameters, not as rope_theta.
    theta = float(_get(reader, f"{prefix}rope.freq_base", 10000.0))
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    scaling = _get(reader, f"{prefix}rope.scaling.type")
    factor = _get(reader, f"{prefix}rope.scaling.factor")
    legacy_linear = _get(reader, f"{prefix}rope.scale_linear")  # key of older converters
    if scaling is None and legacy_linear is not None:
        scaling, factor = "linear", legacy_linear
    scaling = str(scaling or "none")
    orig_ctx = _get(reader, f"{prefix}rope.scaling.original_context_length")
    if scaling == "linear" and factor is not None:
        rope.update(rope_type="linear", factor=float(factor))
    elif scaling == "yarn":
        rope.update(rope_type="yarn", factor=float(factor or 1.0))
        if orig_ctx is not None:
            rope["original_max_position_embeddings"] = int(orig_ctx)
    elif scaling != "none":
        raise ValueError(f"{path}: unsupported rope scaling type {scaling!r}")
    elif "rope_freqs.weight" in tensors:
        factors = _dequantize(tensors["rope_freqs.weight"], path).double().numpy().reshape(-1)
        old_ctx = int(orig_ctx or _LLAMA3_DEFAULT_ORIGINAL_CONTEXT)
        llama3 = _llama3_rope(factors, theta, head_dim, old_ctx, path)
        if llama3 is not None:
            rope.update(llama3)
    return rope


def _special_token_ids(reader: GGUFReader) -> dict[str, int]:
    keys = {"bos": "bos_token_id", "eos": "eos_token_id", "padding": "pad_token_id"}
    ids = {}
    for gguf_name, hf_key in keys.items():
        value = _get(reader, f"tokenizer.ggml.{gguf_name}_token_id")
        if value is not None:
            ids[hf_key] = int(value)
    return ids


def _config_from_reader(reader: GGUFReader, path: str) -> PreTrainedConfig:
    arch = str(_require(reader, "general.architecture", path))
    model_type, hf_arch = _model_type(reader, arch, path)
    prefix = f"{arch}."
    tensors = {t.name: t for t in reader.tensors}
    hidden = _require_int(reader, f"{prefix}embedding_length", path)
    heads = _require_int(reader, f"{prefix}attention.head_count", path)
    kv_field = f"{prefix}attention.head_count_kv"
    kv_heads = _require_int(reader, kv_field, path) if reader.get_field(kv_field) else heads
    head_dim = _head_dim(reader, prefix, tensors, hidden, heads)
    kwargs: dict[str, Any] = {
        "architectures": [hf_arch],
        "vocab_size": _vocab_size(reader, prefix, tensors, path),
        "hidden_size": hidden,
        "intermediate_size": _require_int(reader, f"{prefix}feed_forward_length", path),
        "num_hidden_layers": _require_int(reader, f"{prefix}block_count", path),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rope_parameters": _rope_parameters(reader, prefix, tensors, head_dim, path),
        # llama.cpp drops output.weight when the checkpoint ties it to the embedding.
        "tie_word_embeddings": "output.weight" not in tensors,
        **_special_token_ids(reader),
    }
    eps = _get(reader, f"{prefix}attention.layer_norm_rms_epsilon")
    if eps is not None:
        kwargs["rms_norm_eps"] = float(eps)
    context = _get(reader, f"{prefix}context_length")
    if context is not None:
        kwargs["max_position_embeddings"] = int(context)
    if model_type == "llama":
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in tensors
        kwargs["mlp_bias"] = "blk.0.ffn_up.bias" in tensors
    if model_type == "mistral":
        # MistralConfig defaults to a 4096 window; GGUF only records one if used.
        window = _get(reader, f"{prefix}attention.sliding_window")
        kwargs["sliding_window"] = int(window) if window else None
    return AutoConfig.for_model(model_type, **kwargs)


def load_gguf_config(path: str) -> PreTrainedConfig:
    """Build the Hugging Face config described by the metadata of GGUF file ``path``.

    ``architectures`` is ``LlamaForCausalLM``, ``MistralForCausalLM`` or
    ``Qwen2ForCausalLM``; the rope base lives in ``config.rope_parameters["rope_theta"]``
    (transformers 5 has no ``rope_theta`` attribute), together with linear, YaRN or
    llama3 scaling when the file has it. ``tie_word_embeddings`` is true when the
    file has no ``output.weight``.
    """
    cache_dir = _cache_dir(path, "gguf-configs", _CONFIG_CACHE_VERSION)
    if os.path.isfile(os.path.join(cache_dir, "config.json")):
        config = AutoConfig.from_pretrained(cache_dir, local_files_only=True)
        config._name_or_path = ""  # as built from the file, not a path into the cache
        return config
    config = _config_from_reader(_open_gguf(path), path)
    # Parsing the file's metadata takes seconds; the next start reads a small JSON instead.
    _save_atomically(cache_dir, config.save_pretrained)
    return config


def _cache_dir(path: str, kind: str, version: str) -> str:
    """A cache directory for something derived from GGUF file `path` (by path, size, mtime)."""
    stat = os.stat(path)
    key = f"{os.path.abspath(path)}:{stat.st_size}:{stat.st_mtime_ns}:{version}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return str(cache_root() / kind / digest)


def _save_atomically(cache_dir: str, save: Callable[[str], Any]) -> None:
    """Write into a staging directory and rename it, so a concurrent reader never sees half."""
    staging = f"{cache_dir}.tmp-{os.getpid()}"
    try:
        save(staging)
        os.makedirs(os.path.dirname(cache_dir), exist_ok=True)
        os.replace(staging, cache_dir)
    except OSError as error:  # a read-only home only costs the next start some seconds
        logger.warning("could not write the cache %s: %s", cache_dir, error)
        shutil.rmtree(staging, ignore_errors=True)


# --------------------------------------------------------------------------- tokenizer


def load_gguf_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """Build the tokenizer stored in GGUF file ``path``, with its chat template.

    Converting the GGUF vocabulary takes seconds, so the converted tokenizer is saved
    under the cache directory, keyed by the file's path, size and mtime.
    """
    _check_magic(path)
    cache_dir = _cache_dir(path, "gguf-tokenizers", _TOKENIZER_CACHE_VERSION)
    if os.path.isfile(os.path.join(cache_dir, "tokenizer_config.json")):
        return AutoTokenizer.from_pretrained(cache_dir, local_files_only=True)
    tokenizer = _convert_gguf_tokenizer(path)
    _save_atomically(cache_dir, tokenizer.save_pretrained)
    return tokenizer


def _convert_gguf_tokenizer(path: str) -> PreTrainedTokenizerBase:
    directory, filename = os.path.split(os.path.abspath(path))
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=filename, local_files_only=True)
    if not getattr(tokenizer, "chat_template", None):
        # transformers maps tokenizer.chat_template today; keep the guarantee
        # even if a release stops doing so.
        template = _get(_open_gguf(path), "tokenizer.chat_template")
        if template:
            tokenizer.chat_template = str(template)
    return tokenizer


def _check_magic(path: str) -> None:
    # Cheap early check: without it transformers fails deep inside with an
    # error that does not say the file is the problem.
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{path}: not a valid GGUF file: bad magic {magic!r}")


# --------------------------------------------------------------------------- weights


def _hf_name(gguf_name: str, path: str) -> str | None:
    """HF parameter name for a GGUF tensor name; None for config-only tensors."""
    if gguf_name in _CONFIG_ONLY_TENSORS:
        return None
    match = _BLOCK_TENSOR_RE.fullmatch(gguf_name)
    if match and match[2] in _BLOCK_TENSORS:
        return f"model.layers.{match[1]}.{_BLOCK_TENSORS[match[2]]}.{match[3]}"
    match = _GLOBAL_TENSOR_RE.fullmatch(gguf_name)
    if match and match[1] in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[match[1]]}.{match[2]}"
    raise ValueError(f"{path}: unknown GGUF tensor name {gguf_name!r}")


def _dequantize(tensor: ReaderTensor | GGUFTensor, path: str) -> torch.Tensor:
    if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES:
        raise ValueError(
            f"{path}: tensor {tensor.name!r} has unsupported type {tensor.tensor_type.name}"
        )
    array = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    array = array.reshape(_hf_shape(tensor))
    if not array.flags.writeable:
        # F32 tensors come back as views of the read-only memmap; torch needs
        # memory it may write, and the mapping must not outlive the reader.
        array = array.copy()
    return torch.from_numpy(array)


def _unpermute(weight: torch.Tensor, n_head: int, name: str) -> torch.Tensor:
    """Invert llama.cpp's ``LlamaModel.permute`` on the rows of a q/k weight or bias."""
    rows = weight.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"{name}: {rows} rows do not split into {n_head} rotary heads")
    # The converter reshaped rows to (head, 2, half) and swapped the last two
    # axes; stored rows are therefore (head, half, 2).
    split = weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:])
    return split.transpose(1, 2).reshape(weight.shape).contiguous()


def _plan(tensors: list[GGUFTensor], path: str) -> list[tuple[GGUFTensor, str]]:
    """Map and type-check every tensor before any is dequantized."""
    plan = []
    for tensor in tensors:
        hf_name = _hf_name(tensor.name, path)
        if hf_name is None:
            continue
        if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES:
            raise ValueError(
                f"{path}: tensor {tensor.name!r} has unsupported type {tensor.tensor_type.name}"
            )
        plan.append((tensor, hf_name))
    return plan


def iter_gguf_weights(
    path: str, config: PreTrainedConfig | None = None, skip: frozenset[str] = frozenset()
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, float32 tensor)`` for every parameter stored in GGUF file ``path``.

    Tensors are dequantized one at a time (nothing is retained between yields),
    shaped and named as in the Hugging Face checkpoint, and for Llama/Mistral
    files q_proj/k_proj rows are un-permuted with ``config.num_attention_heads`` /
    ``config.num_key_value_heads``. ``config`` defaults to ``load_gguf_config(path)``.
    ``lm_head.weight`` is only yielded when the file stores it (untied models).
    The file is validated (format, tensor names, tensor types) before this returns.
    Tensors named in ``skip`` (layers that keep the file's blocks) are neither dequantized
    nor yielded.
    """
    cache_dir = _cache_dir(path, "gguf-weights", _WEIGHTS_CACHE_VERSION)
    cached = os.path.join(cache_dir, "model.safetensors")
    if os.path.isfile(cached):
        return _stream_cached(cached, skip)
    tensors, metadata = read_gguf_tensors(path)
    plan = [(tensor, name) for tensor, name in _plan(tensors, path) if name not in skip]
    heads = _permuted_heads(metadata, config or load_gguf_config(path))
    weights = _stream(plan, heads, path)
    if skip or os.path.getsize(path) < _MIN_WEIGHTS_CACHE_BYTES:  # the cache holds all
        return weights
    return _stream_and_cache(weights, cache_dir)


def _stream_cached(cached: str, skip: frozenset[str]) -> Iterator[tuple[str, torch.Tensor]]:
    with safe_open(cached, framework="pt") as checkpoint:
        for name in checkpoint.keys():  # noqa: SIM118 (safe_open is not a dict)
            if name not in skip:
                yield name, checkpoint.get_tensor(name)


def _stream_and_cache(
    weights: Iterator[tuple[str, torch.Tensor]], cache_dir: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the dequantized weights, then save them all for the next start: reading the
    GGUF tensor table and dequantizing costs seconds, a safetensors file is mapped at once."""
    kept: dict[str, torch.Tensor] = {}
    for name, weight in weights:
        kept[name] = weight
        yield name, weight

    def save(directory: str) -> None:
        os.makedirs(directory)
        save_file(kept, os.path.join(directory, "model.safetensors"))

    _save_atomically(cache_dir, save)


def _stream(
    plan: list[tuple[GGUFTensor, str]], heads: dict[str, int], path: str
) -> Iterator[tuple[str, torch.Tensor]]:
    for tensor, hf_name in plan:
        weight = _dequantize(tensor, path)
        projection = hf_name.split(".")[-2]
        if projection in heads:
            weight = _unpermute(weight, heads[projection], f"{path}: {tensor.name}")
        yield hf_name, weight


def _permuted_heads(metadata: dict[str, Any], config: PreTrainedConfig) -> dict[str, int]:
    """Projection -> heads whose rows llama.cpp's converter permuted (Llama and Mistral)."""
    if metadata.get("general.architecture") not in _PERMUTED_ARCHITECTURES:
        return {}
    return {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}


def iter_gguf_raw_weights(
    path: str, config: PreTrainedConfig, types: frozenset[GGMLQuantizationType] | None = None
) -> Iterator[tuple[str, GGMLQuantizationType, np.ndarray]]:
    """Yield ``(hf_name, type, raw rows)`` for every 2-D weight of GGUF file ``path`` (of
    one of `types`, if given), its blocks left as stored: a uint8 array [rows, bytes per
    row] (q/k rows un-permuted like `iter_gguf_weights`: a copy), for layers that compute
    on the blocks themselves."""
    tensors, metadata = read_gguf_tensors(path)
    heads = _permuted_heads(metadata, config)
    for tensor, hf_name in _plan(tensors, path):
        if not hf_name.endswith(".weight") or len(tensor.shape) != 2:
            continue
        if types is not None and tensor.tensor_type not in types:
            continue
        raw = np.asarray(tensor.data)
        projection = hf_name.split(".")[-2]
        if projection in heads:
            rows = torch.from_numpy(raw.reshape(raw.shape[0], -1).copy())
            raw = _unpermute(rows, heads[projection], f"{path}: {tensor.name}").numpy()
        yield hf_name, tensor.tensor_type, raw.reshape(raw.shape[0], -1)
