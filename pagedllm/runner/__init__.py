"""The model runner: builds the model and its KV cache, runs a step, samples, and checks the
cache in debug mode."""
