"""llama.cpp's GGUF checkpoints, one job a module; `pagedllm.model.gguf_loader` is the entry
point the rest of the engine imports."""
