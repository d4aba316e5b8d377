"""`InputProcessor.process_inputs`: the one place a request is checked and built, for the
offline engine and the server alike."""

from types import SimpleNamespace

import pytest

from pagedllm.config import SchedulerConfig
from pagedllm.core.messages import EngineCoreRequest
from pagedllm.errors import InvalidRequestError
from pagedllm.frontend.processor import InputProcessor
from pagedllm.sampling_params import SamplingParams

VOCAB_SIZE = 100


def make_processor(policy="fcfs", max_num_seqs=8, tokenizer=None):
    model_config = SimpleNamespace(
        vocab_size=VOCAB_SIZE, max_model_len=16, max_logprobs=5, eos_token_ids=frozenset({2, 1})
    )
    config = SimpleNamespace(
        model_config=model_config,
        scheduler_config=SchedulerConfig(64, max_num_seqs, 16, policy),
        pooler_config=None,  # the generate runner
    )
    return InputProcessor(config, tokenizer)


def test_builds_one_engine_core_request():
    text, request = make_processor("priority").process_inputs(
        "r",
        {"prompt_token_ids": [5, 6, 7], "prompt": "abc", "cache_salt": "t1"},
        SamplingParams(max_tokens=3),
        priority=-2,
        arrival_time=12.5,
    )
    assert text == "abc"
    assert isinstance(request, EngineCoreRequest)
    assert (request.request_id, request.prompt_token_ids, request.priority) == ("r", [5, 6, 7], -2)
    assert (request.cache_salt, request.arrival_time, request.eos_token_ids) == ("t1", 12.5, [1, 2])


def test_fcfs_refuses_a_priority():
    with pytest.raises(InvalidRequestError, match="priority") as error:
        make_processor().process_inputs("r", {"prompt_token_ids": [5]}, SamplingParams(), 1)
    assert error.value.param == "priority"


@pytest.mark.parametrize(
    ("prompt", "params", "param"),
    [
        ({"prompt_token_ids": [5] * 17}, SamplingParams(), "input_tokens"),
        ({"prompt_token_ids": [VOCAB_SIZE]}, SamplingParams(), "prompt_token_ids"),
        ({"prompt_token_ids": [5]}, SamplingParams(n=9), "n"),
        ({"prompt_token_ids": [5]}, SamplingParams(logprobs=6), "logprobs"),
        ({"prompt_token_ids": [5]}, SamplingParams(logit_bias={VOCAB_SIZE: 1.0}), "logit_bias"),
        ({"prompt_token_ids": [5], "cache_salt": ""}, SamplingParams(), None),
    ],
)
def test_refuses_what_the_engine_cannot_run(prompt, params, param):
    with pytest.raises(ValueError) as error:
        make_processor().process_inputs("r", prompt, params)
    assert getattr(error.value, "param", None) == param
