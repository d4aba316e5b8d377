"""Check a structured-output spec before a request is queued, so a bad schema, regex or
grammar is refused with a message (a 400 at the server) instead of failing in the engine."""

from __future__ import annotations

import json

from pagedllm.errors import InvalidRequestError
from pagedllm.sampling_params import StructuredOutputsParams


def validate_structured_outputs(spec: StructuredOutputsParams, param: str) -> None:
    """Raise InvalidRequestError (naming `param`) if the spec cannot be compiled."""
    if spec.json is not None:
        _check_json_schema(spec.json, param)
    from pagedllm.structured_output.xgrammar_backend import validate_spec

    try:
        validate_spec(spec)
    except ValueError as error:
        raise InvalidRequestError(f"{param}: {error}", param) from None


def _check_json_schema(schema: str | dict, param: str) -> None:
    import jsonschema

    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as error:
            message = f"{param}: the JSON schema is not JSON: {error}"
            raise InvalidRequestError(message, param) from None
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"{param}: a JSON schema must be an object", param)
    validator = jsonschema.validators.validator_for(schema)
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as error:
        where = "/".join(str(p) for p in error.absolute_path) or "(root)"
        raise InvalidRequestError(
            f"{param}: invalid JSON schema at {where}: {error.message}", param
        ) from None
