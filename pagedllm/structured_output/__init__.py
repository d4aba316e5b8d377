"""Structured output: grammars that constrain sampling (JSON schema, regex, choice, EBNF)."""
