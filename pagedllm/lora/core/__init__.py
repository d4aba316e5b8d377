"""LoRA's scheduler side: the adapter slots a step may use."""
