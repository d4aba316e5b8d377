"""LoRA's model side: the layers that add the adapters' deltas to the base projections."""
