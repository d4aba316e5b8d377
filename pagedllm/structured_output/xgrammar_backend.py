"""The xgrammar backend: specs compiled by xgrammar's GrammarCompiler (it caches by spec
too), one xgrammar GrammarMatcher per request."""

from __future__ import annotations

import json
import re
from typing import Any

import torch
import xgrammar as xgr

from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.backend import GrammarMatcher, StructuredOutputBackend

_LOG_PREFIX = re.compile(r"\[[\d:]+\] \S+:\d+: ")


ANY_OBJECT = '{"type": "object"}'


def choice_ebnf(choices: list[str]) -> str:
    # JSON string literals are valid EBNF literals (same escapes).
    return "root ::= " + " | ".join(json.dumps(choice) for choice in choices)


def schema_text(schema: str | dict) -> str:
    return schema if isinstance(schema, str) else json.dumps(schema)


def _json_options(spec: StructuredOutputsParams) -> dict[str, Any]:
    if spec.disable_any_whitespace:
        return {"any_whitespace": False}
    return {"any_whitespace": True, "max_whitespace_cnt": spec.max_whitespace}


class XgrammarMatcher(GrammarMatcher):
    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self._matcher = matcher

    def accept_token(self, token_id: int) -> bool:
        return self._matcher.accept_token(token_id)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()


class XgrammarBackend(StructuredOutputBackend):
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=eos_token_ids or None
        )
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)

    def compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        try:
            return self._compile(spec)
        except (RuntimeError, ValueError, TypeError) as error:
            raise ValueError(f"invalid {spec.kind}: {clean_message(error)}") from None

    def _compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        compiler = self._compiler
        if spec.json is not None:
            return compiler.compile_json_schema(schema_text(spec.json), **_json_options(spec))
        if spec.json_object:  # an object, as OpenAI's json_object means (not any JSON value)
            return compiler.compile_json_schema(ANY_OBJECT, **_json_options(spec))
        if spec.regex is not None:
            return compiler.compile_regex(spec.regex)
        if spec.choice is not None:
            return compiler.compile_grammar(choice_ebnf(spec.choice))
        return compiler.compile_grammar(spec.grammar or "")

    def matcher(self, compiled: xgr.CompiledGrammar) -> XgrammarMatcher:
        return XgrammarMatcher(xgr.GrammarMatcher(compiled))

    def validate(self, spec: StructuredOutputsParams) -> None:
        validate_spec(spec)


def validate_spec(spec: StructuredOutputsParams) -> None:
    """Parse the spec as xgrammar would (no tokenizer needed); ValueError naming the problem."""
    try:
        if spec.json is not None:
            xgr.Grammar.from_json_schema(schema_text(spec.json), **_json_options(spec))
        elif spec.regex is not None:
            xgr.Grammar.from_regex(spec.regex)
        elif spec.choice is not None:
            xgr.Grammar.from_ebnf(choice_ebnf(spec.choice))
        elif spec.grammar is not None:
            xgr.Grammar.from_ebnf(spec.grammar)
    except (RuntimeError, ValueError, TypeError) as error:
        raise ValueError(f"invalid {spec.kind}: {clean_message(error)}") from None


def clean_message(error: Exception) -> str:
    """xgrammar's messages start with a time and a C++ source location; users need neither."""
    return _LOG_PREFIX.sub("", str(error)).strip()
