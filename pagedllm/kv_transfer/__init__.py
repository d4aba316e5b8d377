"""Prefill/decode disaggregation: KV blocks moved from a prefill instance to a decode instance."""
