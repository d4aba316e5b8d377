"""Hypothesis properties of the request path, from a client's values to the engine's request.

- `SamplingParams`: any values of its fields' types either construct, or raise a ValueError
  naming a field; one that constructs crosses the process boundary (msgspec) unchanged.
- The OpenAI request converters (`protocol.py`): any JSON body either becomes SamplingParams
  or is refused with ValueError / InvalidRequestError / pydantic's ValidationError.
- The LoRA adapter routes' bodies (`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`):
  any JSON body either loads or unloads through the server's registry (the engine's own
  adapter reader checks what is loaded) or is refused with an error naming a field.
- `InputProcessor.process_inputs` on the real tokenizer and config: a valid
  `EngineCoreRequest` (token ids within the vocabulary, every integer within 64 bits) or a
  ValueError naming a field.
- The offline `LLM` on a tiny model: random valid requests all finish, the KV cache empties.
- `pagedllm run-batch` lines: any bytes give a request or an error record naming the line,
  written as one UTF-8 JSON line.

Settings are derandomized with a fixed example budget, so every run tries the same inputs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import re
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from pagedllm import LLM
from pagedllm.config import EngineArgs
from pagedllm.core.engine_config import load_engine_config
from pagedllm.core.messages import EngineCoreRequest, input_decoder, input_encoder
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.lora_registry import LoRAModulePath, LoRARegistry
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
)
from pagedllm.entrypoints.openai.tool_calls import plan_tools
from pagedllm.entrypoints.run_batch import DoneSet, item_line, read_requests, record_bytes
from pagedllm.errors import InvalidRequestError
from pagedllm.frontend.processor import InputProcessor
from pagedllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

MAX_MODEL_LEN = 256
MAX_NUM_SEQS = 4
INT64_MIN, UINT64_MAX = -(2**63), 2**64 - 1


def fuzz_settings(max_examples: int) -> settings:
    return settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# ---- value strategies ------------------------------------------------------------------------
EDGE_INTS = [
    0, 1, -1, 2, 255, 256, 49151, 49152, 49153, 2**31 - 1, 2**31, 2**32, 2**53 + 1,
    2**63 - 1, 2**63, 2**64 - 1, 2**64, INT64_MIN, INT64_MIN - 1, 10**30, -(10**30),
]  # fmt: skip
EDGE_FLOATS = [
    0.0, -0.0, 1.0, -1.0, 2.0, -2.0, 2.0000001, 1e-6, 1e-300, 100.0, 100.5, -100.5, 1e308,
    math.nan, math.inf, -math.inf,
]  # fmt: skip
ints = st.one_of(st.integers(-3, 300), st.sampled_from(EDGE_INTS), st.integers())
floats = st.one_of(st.floats(-3, 3), st.sampled_from(EDGE_FLOATS), st.floats(), st.integers(-3, 3))
# Text with lone surrogates now and then (JSON's \ud800 escapes decode to them).
characters = st.one_of(st.characters(), st.characters(categories=["Cs"]))
texts = st.one_of(st.text(max_size=12), st.text(characters, max_size=12))
token_lists = st.lists(ints, max_size=6)


def deep_object(depth: int) -> dict[str, Any]:
    """A JSON schema nested `depth` objects deep (the issue's RecursionError)."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


json_values = st.recursive(
    st.none() | st.booleans() | ints | floats | texts,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=12,
)
json_objects = st.one_of(
    st.dictionaries(texts, json_values, max_size=4), st.integers(20, 300).map(deep_object)
)

# ---- what counts as naming a field -----------------------------------------------------------
SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
REQUEST_FIELDS = (
    SAMPLING_FIELDS
    | set(CompletionRequest.model_fields)
    | set(ChatCompletionRequest.model_fields)
    | {"prompt_token_ids", "input_tokens", "tool_choice", "tools", "chat", "body"}
)


def named_field(error: ValueError, names: set[str]) -> str | None:
    """The field an error names: its `param`, or the first word of its message."""
    param = getattr(error, "param", None)
    if param is not None:
        return param
    head = str(error).split(" ", 1)[0].rstrip(":")
    head = re.split(r"[.\[(=]", head)[0]
    return head if head in names else None


def assert_names_field(error: ValueError, names: set[str]) -> None:
    assert named_field(error, names) is not None, f"error names no field: {error!r}"


# ---- SamplingParams --------------------------------------------------------------------------
structured_kwargs = st.fixed_dictionaries(
    {},
    optional={
        "json": st.one_of(texts, json_objects),
        "regex": texts,
        "choice": st.lists(texts, max_size=3),
        "grammar": texts,
        "json_object": st.none() | st.booleans(),
        "disable_any_whitespace": st.booleans(),
        "max_whitespace": st.none() | ints,
    },
)
sampling_kwargs = st.fixed_dictionaries(
    {},
    optional={
        "n": ints,
        "temperature": floats,
        "top_p": floats,
        "top_k": st.none() | ints,
        "min_p": floats,
        "seed": st.none() | ints,
        "presence_penalty": floats,
        "frequency_penalty": floats,
        "repetition_penalty": floats,
        "logit_bias": st.none() | st.dictionaries(ints, floats, max_size=4),
        "allowed_token_ids": st.none() | token_lists,
        "bad_words": st.none() | st.lists(texts, max_size=3),
        "stop": st.none() | texts | st.lists(texts, max_size=3),
        "stop_token_ids": token_lists,
        "include_stop_str_in_output": st.booleans(),
        "ignore_eos": st.booleans(),
        "max_tokens": st.none() | ints,
        "min_tokens": ints,
        "logprobs": st.none() | ints,
        "prompt_logprobs": st.none() | ints,
        "detokenize": st.booleans(),
        "skip_special_tokens": st.booleans(),
        "spaces_between_special_tokens": st.booleans(),
        "truncate_prompt_tokens": st.none() | ints,
        "output_kind": st.sampled_from(RequestOutputKind),
        "structured_outputs": st.none() | structured_kwargs,
    },
)


def build_sampling_params(kwargs: dict[str, Any]) -> SamplingParams:
    kwargs = dict(kwargs)
    if kwargs.get("structured_outputs") is not None:
        kwargs["structured_outputs"] = StructuredOutputsParams(**kwargs["structured_outputs"])
    return SamplingParams(**kwargs)


def round_trip(request: EngineCoreRequest) -> EngineCoreRequest:
    return input_decoder.decode(input_encoder.encode(request))


@fuzz_settings(600)
@given(kwargs=sampling_kwargs)
def test_sampling_params_construct_or_name_a_field(kwargs):
    try:
        params = build_sampling_params(kwargs)
    except ValueError as error:
        assert_names_field(error, SAMPLING_FIELDS)
        return
    request = EngineCoreRequest("r", [1], params, [0], 0.0)
    assert round_trip(request) == request


# ---- the engine's input path (real tokenizer and config) -------------------------------------
@pytest.fixture(scope="module")
def processor() -> InputProcessor:
    args = EngineArgs(
        max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS, scheduling_policy="priority"
    )
    _, tokenizer, config = load_engine_config(args, log=False)
    return InputProcessor(config, tokenizer)


def all_ints(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, dict):
        return [i for k, v in value.items() for i in all_ints(k) + all_ints(v)]
    if isinstance(value, list | tuple):
        return [i for item in value for i in all_ints(item)]
    if dataclasses.is_dataclass(value):
        return all_ints(dataclasses.asdict(value))
    if isinstance(value, msgspec.Struct):
        return all_ints(msgspec.structs.asdict(value))
    return []


def check_engine_request(request: EngineCoreRequest, processor: InputProcessor) -> None:
    """What the core may assume of every request that passed the edge."""
    vocab_size = processor.config.model_config.vocab_size
    params = request.sampling_params
    assert 1 <= len(request.prompt_token_ids) <= MAX_MODEL_LEN
    token_fields = {
        "prompt_token_ids": request.prompt_token_ids,
        "eos_token_ids": request.eos_token_ids,
        "stop_token_ids": params.stop_token_ids,
        "allowed_token_ids": params.allowed_token_ids or [],
        "logit_bias": list(params.logit_bias or {}),
        "bad_words_token_ids": [t for word in request.bad_words_token_ids or [] for t in word],
    }
    for name, ids in token_fields.items():
        bad = [t for t in ids if type(t) is not int or not 0 <= t < vocab_size]
        assert not bad, f"{name}: {bad[:5]} outside [0, {vocab_size})"
    wide = [i for i in all_ints(request) if not INT64_MIN <= i <= UINT64_MAX]
    assert not wide, f"integers wider than 64 bits reached the engine: {wide[:5]}"
    if params.seed is not None:
        assert params.seed + params.n - 1 <= UINT64_MAX
    floats_ = [
        params.temperature,
        params.top_p,
        params.min_p,
        params.presence_penalty,
        params.frequency_penalty,
        params.repetition_penalty,
        *(params.logit_bias or {}).values(),
    ]
    assert all(math.isfinite(x) for x in floats_), floats_
    assert round_trip(request) == request


def process_or_refuse(processor: InputProcessor, prompt: Any, params: SamplingParams, priority=0):
    try:
        _, request = processor.process_inputs("fuzz", prompt, params, priority)
    except ValueError as error:
        assert_names_field(error, REQUEST_FIELDS)
        return None
    check_engine_request(request, processor)
    return request


prompts = st.one_of(
    texts,
    st.text(max_size=300),
    st.fixed_dictionaries(
        {"prompt_token_ids": st.lists(ints, max_size=20)},
        optional={"prompt": texts, "cache_salt": st.none() | texts},
    ),
    st.fixed_dictionaries(
        {"prompt_token_ids": st.lists(st.integers(0, 49151), min_size=1, max_size=300)}
    ),
    st.fixed_dictionaries({"prompt": texts}),
)
one_structured_kwargs = st.one_of(
    st.fixed_dictionaries({"json": st.one_of(texts, json_objects)}),
    st.fixed_dictionaries({"regex": texts}),
    st.fixed_dictionaries({"choice": st.lists(texts, min_size=1, max_size=3)}),
    st.fixed_dictionaries({"grammar": texts}),
    st.just({"json_object": True}),
)
# Token ids: in the vocabulary (SmolLM2's 49152), around its end, or anything.
vocab_ids = st.one_of(st.integers(0, 49151), st.integers(49140, 49160), ints)
# Plausible scalars, adversarial ids, seeds, lengths and words: most of these construct, so
# the processor's own checks are what is exercised.
plausible_kwargs = st.fixed_dictionaries(
    {},
    optional={
        "n": st.integers(1, MAX_NUM_SEQS + 1),
        "temperature": st.floats(0, 2),
        "seed": st.none() | ints,
        "logit_bias": st.none() | st.dictionaries(vocab_ids, st.floats(-100, 100), max_size=3),
        "allowed_token_ids": st.none() | st.lists(vocab_ids, min_size=1, max_size=4),
        "bad_words": st.none() | st.lists(texts, max_size=3),
        "stop": st.none() | st.lists(st.text(min_size=1, max_size=8) | texts, max_size=3),
        "stop_token_ids": st.lists(vocab_ids, max_size=4),
        "max_tokens": st.none() | st.integers(1, 300) | ints,
        "min_tokens": st.integers(0, 4) | ints,
        "logprobs": st.none() | st.integers(0, 25) | ints,
        "prompt_logprobs": st.none() | st.integers(0, 25) | ints,
        "truncate_prompt_tokens": st.none() | st.integers(1, 300) | ints,
        "structured_outputs": st.none() | one_structured_kwargs,
    },
)


@fuzz_settings(400)
@given(prompt=prompts, kwargs=plausible_kwargs, priority=st.integers(-3, 3) | ints)
def test_input_processor_builds_a_valid_request_or_names_a_field(
    processor, prompt, kwargs, priority
):
    try:
        params = build_sampling_params(kwargs)
    except ValueError:
        reject()  # SamplingParams' own refusals are the test above
    process_or_refuse(processor, prompt, params, priority)


# ---- the OpenAI request converters -----------------------------------------------------------
# JSON numbers for the converters: mostly small and plausible, some extreme.
json_ints = st.one_of(st.integers(-1, 8), ints)
json_floats = st.one_of(st.floats(0, 1), floats)


def from_json_schema(schema: dict[str, Any], defs: dict[str, Any], wrong: bool, depth: int = 0):
    """Values for a pydantic model's JSON schema: of the declared types with extreme ints,
    floats and strings, and with `wrong`, now and then a value of another type."""
    if "$ref" in schema:
        return from_json_schema(defs[schema["$ref"].rsplit("/", 1)[1]], defs, wrong, depth)
    if "anyOf" in schema:
        return st.one_of([from_json_schema(s, defs, wrong, depth) for s in schema["anyOf"]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    simple = {
        "integer": json_ints,
        "number": json_floats,
        "string": texts,
        "boolean": st.booleans(),
        "null": st.none(),
    }
    if kind in simple:
        return simple[kind]
    if kind == "array":
        items = from_json_schema(schema.get("items", {}), defs, wrong, depth + 1)
        return st.lists(items, min_size=schema.get("minItems", 0), max_size=4)
    if kind == "object" and "properties" in schema and depth < 4:
        return objects(schema, defs, wrong, depth + 1)
    if kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        inner = from_json_schema(schema["additionalProperties"], defs, wrong, depth + 1)
        return st.dictionaries(texts | json_ints.map(str), inner, max_size=4)
    if kind == "object":
        return json_objects
    return json_values


def objects(schema: dict[str, Any], defs: dict[str, Any], wrong: bool, depth: int = 0):
    properties = schema["properties"]
    required = set(schema.get("required", ()))

    def field(sub: dict[str, Any]):
        typed = from_json_schema(sub, defs, wrong, depth)
        return st.one_of(typed, json_values) if wrong else typed

    return st.fixed_dictionaries(
        {name: field(sub) for name, sub in properties.items() if name in required},
        optional={name: field(sub) for name, sub in properties.items() if name not in required},
    )


def bodies(model) -> st.SearchStrategy[dict[str, Any]]:
    """Bodies of the declared types, and bodies with values of other types here and there."""
    schema = model.model_json_schema()
    defs = schema.get("$defs", {})
    return st.one_of(objects(schema, defs, wrong=False), objects(schema, defs, wrong=True))


def with_structured_output(processor, params: SamplingParams, sources) -> SamplingParams:
    """As the server does: at most one constraint, checked by the processor."""
    if len(sources) != 1:
        return params
    field_name, spec = sources[0]
    params = dataclasses.replace(params, structured_outputs=spec)
    processor.check_structured_outputs(params, field_name)
    return params


# The converters' refusals; pydantic's ValidationError is a ValueError too.
REFUSALS = (ValueError, InvalidRequestError, ValidationError)


@fuzz_settings(500)
@given(body=bodies(CompletionRequest))
def test_completion_request_converts_or_refuses(processor, body):
    try:
        request = CompletionRequest.model_validate(body)
        request.refused_fields()
        request.check_stream_options()
        sources = request.structured_output_sources()
        max_tokens = 16 if request.max_tokens is None else request.max_tokens
        params = request.sampling_params(max_tokens, request.logprobs, request.prompt_logprobs)
        params = with_structured_output(processor, params, sources)
    except REFUSALS as error:
        if not isinstance(error, ValidationError):
            assert_names_field(error, REQUEST_FIELDS)
        return
    prompt = request.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        prompt = prompt[0]
    if isinstance(prompt, list):
        prompt = {"prompt_token_ids": prompt}
    process_or_refuse(processor, prompt, params, request.priority)


@fuzz_settings(500)
@given(body=bodies(ChatCompletionRequest))
def test_chat_request_converts_or_refuses(processor, body):
    try:
        request = ChatCompletionRequest.model_validate(body)
        request.check_stream_options()
        plan = plan_tools(request.tools, request.tool_choice, request.parallel_tool_calls, "hermes")
        [message.for_template() for message in request.messages]
        sources = request.structured_output_sources()
        tool_constraint = plan.constraint()
        if tool_constraint is not None:
            sources.append(("tool_choice", tool_constraint))
        max_tokens = request.max_completion_tokens or request.max_tokens or 8
        params = request.sampling_params(
            max_tokens, request.num_logprobs(), request.prompt_logprobs
        )
        params = with_structured_output(processor, params, sources)
    except REFUSALS as error:
        if not isinstance(error, ValidationError):
            assert_names_field(error, REQUEST_FIELDS)
        return
    process_or_refuse(processor, {"prompt_token_ids": [1, 2, 3]}, params, request.priority)


# ---- the LoRA adapter routes ------------------------------------------------------------------
LORA_FIELDS = set(LoadLoRAAdapterRequest.model_fields) | set(UnloadLoRAAdapterRequest.model_fields)


@pytest.fixture(scope="module")
def lora_setup(tiny_llama, tmp_path_factory):
    """The engine's adapter check for a tiny LoRA engine, and one adapter it accepts."""
    from lora_utils import make_peft_adapter

    _, _, config = load_engine_config(EngineArgs(str(tiny_llama), enable_lora=True), log=False)
    adapter = make_peft_adapter(tiny_llama, tmp_path_factory.mktemp("fuzz-lora"), seed=5, rank=4)
    return InputProcessor(config, None).check_lora_adapter, str(adapter)


def refused_naming_a_field(error: Exception) -> None:
    if isinstance(error, ValidationError):
        return
    param = getattr(error, "param", None)
    assert param in LORA_FIELDS, f"{type(error).__name__} names no field: {error}"
    if isinstance(error, OpenAIError):
        assert error.status in (400, 404), error.status


@fuzz_settings(300)
@given(data=st.data())
def test_lora_adapter_bodies_load_unload_or_name_a_field(lora_setup, data):
    """As the routes do: a body is validated, then loaded or unloaded through the registry
    (one static adapter "a" is served); a load that succeeds is served under a new id, and
    an unload that succeeds stops serving the name."""
    check, adapter = lora_setup
    registry = LoRARegistry(("base",), check)
    registry.add_static((LoRAModulePath("a", adapter),))
    good_load = st.builds(lambda name: {"lora_name": name, "lora_path": adapter}, texts)
    load = data.draw(st.one_of(bodies(LoadLoRAAdapterRequest), good_load))
    names = st.sampled_from(["a", "base"]) | texts
    good_unload = st.fixed_dictionaries({"lora_name": names}, optional={"lora_int_id": ints})
    unload = data.draw(st.one_of(bodies(UnloadLoRAAdapterRequest), good_unload))
    try:
        request = LoadLoRAAdapterRequest.model_validate(load)
        loaded = asyncio.run(registry.load(request.lora_name, request.lora_path))
    except (*REFUSALS, OpenAIError) as error:
        refused_naming_a_field(error)
    else:
        assert registry.resolve(request.lora_name) == loaded
        assert loaded.lora_int_id > registry.resolve("a").lora_int_id
    try:
        request = UnloadLoRAAdapterRequest.model_validate(unload)
        registry.unload(request.lora_name, request.lora_int_id)
    except (*REFUSALS, OpenAIError) as error:
        refused_naming_a_field(error)
    else:
        with pytest.raises(OpenAIError):
            registry.resolve(request.lora_name)


# ---- the offline engine: random valid requests all finish ------------------------------------
TINY_VOCAB = 512


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama) -> LLM:
    return LLM(str(tiny_llama), max_model_len=64, max_num_seqs=4, block_size=8, max_logprobs=3)


valid_requests = st.lists(
    st.tuples(
        st.lists(st.integers(0, TINY_VOCAB - 1), min_size=1, max_size=40),
        st.builds(
            SamplingParams,
            n=st.integers(1, 3),
            temperature=st.sampled_from([0.0, 0.7, 1.0]),
            top_p=st.sampled_from([1.0, 0.9]),
            top_k=st.sampled_from([-1, 1, 5]),
            seed=st.none() | st.integers(0, 2**64 - 3),
            logit_bias=st.none()
            | st.dictionaries(st.integers(0, TINY_VOCAB - 1), st.floats(-100, 100), max_size=2),
            stop_token_ids=st.lists(st.integers(0, TINY_VOCAB - 1), max_size=2),
            ignore_eos=st.booleans(),
            max_tokens=st.integers(4, 8),
            min_tokens=st.integers(0, 4),
            logprobs=st.none() | st.integers(0, 3),
            prompt_logprobs=st.none() | st.integers(0, 3),
        ),
    ),
    min_size=1,
    max_size=6,
)


@fuzz_settings(15)
@given(requests=valid_requests)
def test_offline_requests_all_finish_and_free_the_cache(tiny_llm, requests):
    prompts = [{"prompt_token_ids": ids} for ids, _ in requests]
    params = [p for _, p in requests]
    outputs = tiny_llm.generate(prompts, params, use_tqdm=False)
    assert len(outputs) == len(requests)
    for output, each in zip(outputs, params, strict=True):
        assert output.finished
        assert len(output.outputs) == each.n
        for completion in output.outputs:
            assert completion.finish_reason in ("length", "stop")
            assert 1 <= len(completion.token_ids) <= each.max_tokens
    engine = tiny_llm.llm_engine
    assert not engine.has_unfinished_requests()
    kv = engine.engine_core.kv_cache_manager
    kv.check_integrity()
    assert kv.num_free_blocks == kv.block_pool.num_usable_blocks
    assert tiny_llm.get_stats().kv_cache_usage == 0


# ---- run-batch lines ------------------------------------------------------------------------
_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
_BATCH_LINES = st.one_of(
    st.binary(max_size=120),  # anything, invalid UTF-8 included
    _JSON_VALUES.map(lambda value: json_line(value)),
    st.builds(
        lambda custom_id, url, body: json_line(
            {"custom_id": custom_id, "method": "POST", "url": url, "body": body}
        ),
        st.text(max_size=12),
        st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/x"]),
        _JSON_VALUES,
    ),
    st.integers(1, 3000).map(lambda depth: b"[" * depth),
    st.integers(1, 3000).map(lambda digits: b'{"custom_id": "a", "n": ' + b"9" * digits + b"}"),
)


def json_line(value: Any) -> bytes:
    return json.dumps(value).encode("utf-8", "surrogatepass")


@fuzz_settings(400)
@given(st.lists(_BATCH_LINES.filter(lambda line: b"\n" not in line), max_size=6))
def test_every_run_batch_line_is_a_request_or_an_error_record_written_as_utf8_json(lines):
    """Each non-blank line of a batch file is read on its own: a request, or a record that
    names the line, and that record is one valid UTF-8 JSON line (nothing raises)."""
    items = list(read_requests(lines, DoneSet()))
    assert len(items) == sum(1 for line in lines if line.strip())
    for item in items:
        if isinstance(item, dict):
            written = record_bytes(item, item_line(item))
            assert written.endswith(b"\n") and b"\n" not in written[:-1]
            assert isinstance(json.loads(written.decode("utf-8")), dict)
