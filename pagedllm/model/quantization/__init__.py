"""Checkpoints stored quantized (GPTQ, AWQ, compressed-tensors, FP8): detection and formats.

`registry.py` decides from config.json's `quantization_config` which method a checkpoint
uses and whether it is served (one file per method); `gptq_format.py`, `awq_format.py` and
`ct_pack_format.py` read each format's packed tensors into the same integers and scales.
The layers that compute on them are under `model/layers/` (`gptq_linear.py`,
`packed_swap.py`).
"""
