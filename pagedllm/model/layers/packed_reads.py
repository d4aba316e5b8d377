"""Reading a checkpoint's packed layers (GPTQ, AWQ, compressed-tensors pack-quantized): first
only where each tensor is and its shape (`index_layer_tensors`, the safetensors headers),
then, layer by layer, only the output rows this rank keeps (`read_layer`, through
safetensors' `get_slice`), so a tensor-parallel rank reads about 1/tp of each split layer
and a pipeline stage none of another stage's layers (as the dense loader reads its shards).

A format says where its tensors hold the layer's outputs (`PackedLayout`): along which
dimension, and how many outputs one stored element packs (GPTQ's and AWQ's zero points,
AWQ's weights: 8 four-bit values to an int32 along the outputs; compressed-tensors' zero
points 32 / bits). A rank's rows are read as a window widened to whole words of 8 outputs
(`word_window`: at most 7 rows either side), which is a layer of that format in its own
right, so each format's reader unpacks it unchanged; the rank's rows are cut from it after.
Tensors not along the outputs (act-order's `g_idx`) are read whole. Each layer's file is
opened for its reads and closed after, so the pages read leave the process with it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

# Outputs a window starts and ends on (the last may end at the layer's last output): 8
# four-bit or 4 eight-bit values fill an int32 word.
WORD_OUTPUTS = 8

# leaf -> (the dimension holding the outputs, outputs one stored element holds)
OutputAxes = dict[str, tuple[int, int]]


@dataclass(frozen=True)
class StoredTensor:
    """A checkpoint tensor not read yet: its file, name and shape."""

    path: str
    name: str
    shape: tuple[int, ...]


LayerSource = dict[str, "StoredTensor | torch.Tensor"]  # leaf -> stored (or in memory)
LayerTensors = dict[str, torch.Tensor]


def _as_read(tensors: LayerTensors, window: range, rows: int) -> LayerTensors:
    return tensors


@dataclass(frozen=True)
class PackedLayout:
    """Where a format's tensors hold a layer's output rows (module docstring)."""

    rows: tuple[str, int]  # (leaf, dimension) whose length is the layer's output rows
    axes: Callable[[str], OutputAxes]  # checkpoint prefix -> its tensors' output axes
    # (tensors read for `window` of `rows` outputs) -> a layer of `len(window)` outputs, where
    # a tensor records the layer's shape (compressed-tensors' `weight_shape`).
    narrowed: Callable[[LayerTensors, range, int], LayerTensors] = field(default=_as_read)


def index_layer_tensors(
    directory: str, leaves: tuple[str, ...], required: tuple[str, ...], method: str
) -> dict[str, LayerSource]:
    """Layer prefix (HF name without the leaf) -> its tensors named by `leaves`, not read,
    for every prefix holding `required[0]`, from every safetensors file of `directory`."""
    from safetensors import safe_open

    found: dict[str, LayerSource] = {}
    for file_name in sorted(f for f in os.listdir(directory) if f.endswith(".safetensors")):
        path = os.path.join(directory, file_name)
        with safe_open(path, framework="pt") as checkpoint:
            for name in checkpoint.keys():  # noqa: SIM118 (safe_open is not a dict)
                prefix, _, leaf = name.rpartition(".")
                if leaf in leaves:
                    shape = tuple(checkpoint.get_slice(name).get_shape())
                    found.setdefault(prefix, {})[leaf] = StoredTensor(path, name, shape)
    layers = {p: t for p, t in found.items() if required[0] in t}
    for prefix, tensors in layers.items():
        missing = [n for n in required if n not in tensors]
        if missing:
            raise ValueError(f"{method} layer {prefix!r} lacks {', '.join(missing)}")
    return layers


def output_rows(source: LayerSource, layout: PackedLayout) -> int:
    """The layer's output rows, from its shapes (nothing is read)."""
    leaf, dim = layout.rows
    shape = tuple(source[leaf].shape)
    if len(shape) <= dim:
        raise ValueError(f"{leaf} {shape} has no dimension {dim} of outputs")
    return shape[dim]


def _check_output_lengths(source: LayerSource, axes: OutputAxes, rows: int) -> None:
    """Each tensor cut along the outputs holds `rows` of them, before any is cut: the first
    elements of a tensor of another layout (zero points one a word, say) are other values,
    which a window's length would no longer show."""
    for leaf, (dim, per_element) in axes.items():
        if leaf not in source:
            continue
        shape = tuple(source[leaf].shape)
        if len(shape) <= dim or shape[dim] != -(-rows // per_element):
            raise ValueError(
                f"{leaf} {shape} does not hold {rows} outputs along dimension {dim} "
                f"({per_element} an element)"
            )


def word_window(start: int, end: int, rows: int) -> range:
    """Outputs [start, end) of `rows`, widened to whole words (module docstring)."""
    first = start - start % WORD_OUTPUTS
    last = min(rows, -(-end // WORD_OUTPUTS) * WORD_OUTPUTS)
    return range(first, last)


def read_layer(
    source: LayerSource, layout: PackedLayout, prefix: str, window: range
) -> LayerTensors:
    """The layer's tensors for outputs `window` (all of them: range(0, rows))."""
    from safetensors import safe_open

    rows = output_rows(source, layout)
    whole = window == range(rows)
    axes = {} if whole else layout.axes(prefix)
    _check_output_lengths(source, axes, rows)
    bounds = {leaf: _element_bounds(axes.get(leaf), window) for leaf in source}
    tensors: LayerTensors = {}
    for path in sorted({s.path for s in source.values() if isinstance(s, StoredTensor)}):
        with safe_open(path, framework="pt") as checkpoint:
            for leaf, stored in source.items():
                if isinstance(stored, StoredTensor) and stored.path == path:
                    tensors[leaf] = read_stored(checkpoint, stored, *bounds[leaf])
    for leaf, held in source.items():
        if isinstance(held, torch.Tensor):
            dim, first, last = bounds[leaf]
            tensors[leaf] = held if dim is None else held.narrow(dim, first, last - first)
    return tensors if whole else layout.narrowed(tensors, window, rows)


def _element_bounds(axis: tuple[int, int] | None, window: range):
    """(dimension, first, last element) holding outputs `window`; (None, 0, 0): all."""
    if axis is None:
        return None, 0, 0
    dim, per_element = axis
    return dim, window.start // per_element, -(-window.stop // per_element)


def read_stored(checkpoint, stored: StoredTensor, dim: int | None, first: int, last: int):
    """One tensor from an open safetensors file: elements [first, last) along `dim`, or all
    of it (dim None). The one place packed tensors are read (tests record the reads here)."""
    handle = checkpoint.get_slice(stored.name)
    if dim is None:
        return handle[:] if stored.shape else handle[()]
    index = [slice(None)] * len(stored.shape)
    index[dim] = slice(first, last)
    return handle[tuple(index)]
