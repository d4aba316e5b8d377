"""Speculative decoding's scheduler side: lookahead slots and draft tokens in the scheduling
loop."""
