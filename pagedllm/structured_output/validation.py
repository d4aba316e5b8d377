"""Check a structured-output spec before a request is queued, so a bad schema, regex or
grammar is refused with a message (a 400 at the server) instead of failing in the engine.

Specs are bounded before anything parses them: a JSON schema nested deeper than
`MAX_SCHEMA_DEPTH` (a RecursionError in jsonschema's checks past ~100 levels) or any spec
larger than `MAX_SPEC_BYTES` is refused. What passes compiles in the engine core with a
time limit (`manager.GRAMMAR_COMPILE_TIMEOUT_S`).
"""

from __future__ import annotations

import json

from pagedllm.errors import InvalidRequestError
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.value_checks import check_json_value

# Nesting of a JSON schema document: objects and arrays, the schema itself being level 1
# ({"type": "object", "properties": {"a": {...}}} is 3 levels to reach "a"'s schema).
# Real schemas stay far below; jsonschema's own checks recurse ~10 Python frames a level.
MAX_SCHEMA_DEPTH = 64
# Size of a spec as the compiler reads it: the schema's JSON text, the regex, the grammar,
# or all the choices together (UTF-8 bytes).
MAX_SPEC_BYTES = 64 * 1024


def validate_structured_outputs(spec: StructuredOutputsParams, param: str) -> None:
    """Raise InvalidRequestError (naming `param`) if the spec is too large or too deep, or
    cannot be compiled."""
    if spec.json is not None:
        _check_json_schema(spec.json, param)
    for text in (spec.regex, spec.grammar):
        if text is not None:
            _check_size(text, spec.kind, param)
    if spec.choice is not None:
        _check_size("".join(spec.choice), "choice list", param)
    from pagedllm.structured_output.xgrammar_backend import validate_spec

    try:
        validate_spec(spec)
    except (ValueError, RecursionError) as error:
        raise InvalidRequestError(f"{param}: {error}", param) from None


def _check_size(text: str, what: str, param: str) -> None:
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_SPEC_BYTES:
        raise InvalidRequestError(
            f"{param}: the {what} is {size} bytes; at most {MAX_SPEC_BYTES} are accepted", param
        )


def _check_json_schema(schema: str | dict, param: str) -> None:
    import jsonschema

    if isinstance(schema, str):
        _check_size(schema, "JSON schema", param)
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as error:
            message = f"{param}: the JSON schema is not JSON: {error}"
            raise InvalidRequestError(message, param) from None
        except RecursionError:
            raise InvalidRequestError(
                f"{param}: the JSON schema is nested more than {MAX_SCHEMA_DEPTH} levels deep",
                param,
            ) from None
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"{param}: a JSON schema must be an object", param)
    # Depth first (an iterative walk), so nothing below recurses through a deep document.
    try:
        check_json_value(schema, MAX_SCHEMA_DEPTH, "schema", param)
    except InvalidRequestError as error:
        raise InvalidRequestError(f"{param}: invalid JSON schema: {error}", param) from None
    try:
        _check_size(json.dumps(schema), "JSON schema", param)
    except (TypeError, ValueError) as error:
        if isinstance(error, InvalidRequestError):
            raise
        message = f"{param}: the JSON schema is not JSON: {error}"
        raise InvalidRequestError(message, param) from None
    validator = jsonschema.validators.validator_for(schema)
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as error:
        where = "/".join(str(p) for p in error.absolute_path) or "(root)"
        raise InvalidRequestError(
            f"{param}: invalid JSON schema at {where}: {error.message}", param
        ) from None
    except RecursionError:
        raise InvalidRequestError(f"{param}: the JSON schema is nested too deeply", param) from None
