"""Checkpoints stored quantized (GPTQ, AWQ, compressed-tensors, FP8): detection and formats.

`registry.py` decides from config.json's `quantization_config` which method a checkpoint
uses and whether it is served (one file per method); `gptq_format.py` reads GPTQ's packed
tensors. The layers that compute on them are under `model/layers/` (`gptq_linear.py`).
"""
