"""lm-eval's `local-completions` model against `pagedllm serve`, run in-process
(`lm_eval.simple_evaluate`) on tiny tasks written to the test's folder: a generate_until
task with no client tokenizer, a multiple-choice (loglikelihood) task with the default
model's tokenizer saved as a Hugging Face directory, and the `remote` tokenizer backend
that reads the server's `/tokenizer_info`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from pagedllm.model.gguf.tokenizer import load_gguf_tokenizer
from pagedllm.model.loader import default_model_path

from .common import API_KEY, MODEL

if TYPE_CHECKING:
    from lm_eval.tasks import TaskManager


DOCS = [
    {
        "question": "The capital of France is",
        "choices": [" Paris", " banana", " seven"],
        "answer": 0,
    },
    {"question": "Two plus two equals", "choices": [" blue", " four", " Tuesday"], "answer": 1},
    {"question": "On a clear day the sky is", "choices": [" loud", " heavy", " blue"], "answer": 2},
]

# Task configs as lm-eval's YAML files hold them (JSON is YAML); `{data}` is the docs file.
MULTIPLE_CHOICE = {
    "output_type": "multiple_choice",
    "doc_to_text": "{{question}}",
    "doc_to_choice": "{{choices}}",
    "doc_to_target": "answer",
    "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
}
GENERATE_UNTIL = {
    "output_type": "generate_until",
    "doc_to_text": "Q: {{question}}\nA:",
    "doc_to_target": "{{choices[answer]}}",
    "generation_kwargs": {"until": ["\n"], "max_gen_toks": 8, "do_sample": False},
    "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
}


@pytest.fixture(scope="module")
def task_manager(tmp_path_factory) -> TaskManager:
    from lm_eval.tasks import TaskManager

    folder = tmp_path_factory.mktemp("lm-eval-tasks")
    data = folder / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    for name, config in (("tiny_mc", MULTIPLE_CHOICE), ("tiny_gen", GENERATE_UNTIL)):
        task = {
            "task": name,
            "dataset_path": "json",  # `datasets`' local JSON loader: no hub
            "dataset_kwargs": {"data_files": {"test": str(data)}},
            "test_split": "test",
            **config,
        }
        (folder / f"{name}.yaml").write_text(json.dumps(task))
    return TaskManager(include_path=str(folder))


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """The default model's tokenizer as a Hugging Face folder: the GGUF holds it, and
    lm-eval's `huggingface` backend needs a folder to count context tokens."""
    folder = tmp_path_factory.mktemp("tokenizer")
    load_gguf_tokenizer(default_model_path()).save_pretrained(folder)
    return folder


def _evaluate(server, task_manager: TaskManager, task: str, **model_args: Any) -> dict:
    import lm_eval

    model_args = {
        "model": MODEL,
        "base_url": server.base_url + "/v1/completions",
        "auth_token": API_KEY,
        "num_concurrent": 1,
        "max_retries": 1,
        **model_args,
    }
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=model_args,
        tasks=[task],
        task_manager=task_manager,
        limit=len(DOCS),
    )
    return results["results"][task]


@pytest.fixture(autouse=True)
def api_key(monkeypatch) -> None:
    # local-completions sends the key from OPENAI_API_KEY (auth_token only reaches the
    # remote tokenizer's requests).
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)


def test_generate_until_without_a_client_tokenizer(server, task_manager) -> None:
    result = _evaluate(
        server, task_manager, "tiny_gen", tokenizer_backend=None, tokenized_requests=False
    )
    assert 0.0 <= result["exact_match,none"] <= 1.0


def test_multiple_choice_loglikelihoods(server, task_manager, tokenizer_dir) -> None:
    # echo + logprobs scores each choice; the 135M model gets these three right.
    result = _evaluate(
        server,
        task_manager,
        "tiny_mc",
        tokenizer_backend="huggingface",
        tokenizer=str(tokenizer_dir),
    )
    assert result["acc,none"] == 1.0


def test_multiple_choice_with_the_servers_tokenizer(server, task_manager) -> None:
    result = _evaluate(server, task_manager, "tiny_mc", tokenizer_backend="remote")
    assert result["acc,none"] == 1.0
