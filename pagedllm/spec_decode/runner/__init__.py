"""Speculative decoding's runner side: proposers (n-gram, suffix, draft model) and the
rejection sampler."""
