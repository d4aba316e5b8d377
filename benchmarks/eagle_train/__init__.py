"""Distilling an EAGLE-3 head for the default model on this CPU (benchmarks/train_eagle.py):
prompts, the target's generations and hidden states, the head in torch, its training, and
its directory in the published layout."""
