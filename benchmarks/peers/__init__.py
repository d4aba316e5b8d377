"""Peer engines for `benchmarks.compare`: vLLM (CPU build), llama.cpp and Transformers.

The package owns everything about the peers that our own engine does not need: installing
each into its own virtualenv or build directory under a cache root outside the repository
(`install`, `llamacpp`, `vllm`), the fp32 weights they share (`models`), the commands that
run the same workloads on every engine (`offline`, `serving`), the servers' lifecycle
(`servers`) and the side-by-side report (`report`). `common` holds the paths, the command
runner with its dry-run mode, and the stamp files that make installs idempotent.

Files named `run_*.py`, `vllm_cli.py` and `export_hf_model.py` are scripts run by *other*
interpreters (the vLLM virtualenv, our `.venv`): they import nothing from this package.
"""
