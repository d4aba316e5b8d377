"""Speculative decoding: proposers (n-gram, suffix, draft model), the speculative config,
and the rejection sampler that keeps the target model's output distribution exact."""
