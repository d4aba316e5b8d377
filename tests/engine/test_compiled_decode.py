"""The compiled decode step (by default where it is exact, or `compile=True`): decode steps
run one torch.compile'd graph whose output is the eager forward's, for every batch size up
to the compiled range, without compiling again; where the graph is not tested exact, the
default stays eager and says why."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
import torch
from model_utils import model_runner, small_engine
from torch._dynamo.utils import counters

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineArgs
from pagedllm.entrypoints.engine_flags import add_engine_args, engine_args_from
from pagedllm.ops import fused
from pagedllm.runner import compile_choice
from pagedllm.runner.compiled_forward import MAX_BATCH_SIZE


def _generate(llm: LLM, prompts: list[list[int]]) -> list:
    # Different lengths: requests finish one after another, so decode batches shrink from
    # len(prompts) to 1, and contexts cross block boundaries (block tables widen).
    params = [
        SamplingParams(temperature=0, max_tokens=8 + 5 * i, ignore_eos=True, logprobs=2)
        for i in range(len(prompts))
    ]
    batch = [{"prompt_token_ids": p} for p in prompts]
    return [o.outputs[0] for o in llm.generate(batch, params, use_tqdm=False)]


def _assert_same_bits(want: list, got: list) -> None:
    """The same tokens with the same logprobs, bit for bit: the same kernels in the same
    order."""
    for a, b in zip(want, got, strict=True):
        assert a.token_ids == b.token_ids
        for position, token in enumerate(a.token_ids):
            assert b.logprobs[position][token].logprob == a.logprobs[position][token].logprob


# Gemma 3: query and key norms on strided head ranges (a reshape there once specialized the
# graph on a single request, so the first lone request compiled a second graph), a float
# soft-cap, and windowed and full KV cache groups. Phi-3: its fused checkpoint rows. The
# mixtures: their routers (a graph's own softmax once moved a routing weight's last bits).
# Each compiled by default (the suite's PAGEDLLM_COMPILE=0 lifted).
@pytest.mark.parametrize(
    "architecture",
    [
        "LlamaForCausalLM",
        "Gemma3ForCausalLM",
        "Phi3ForCausalLM",
        "MixtralForCausalLM",
        "Qwen3MoeForCausalLM",
    ],
)
def test_compiled_decode_equals_eager_at_every_batch_size(
    tiny_model_factory, architecture, monkeypatch
):
    directory = tiny_model_factory(architecture)
    eager = small_engine(directory, enforce_eager=True)
    graphs_before = counters["stats"]["unique_graphs"]
    monkeypatch.delenv("PAGEDLLM_COMPILE")
    compiled = small_engine(directory)
    assert counters["stats"]["unique_graphs"] == graphs_before + 1  # compiled at start-up
    runner = model_runner(compiled)
    batch_sizes = []
    inner = runner.compiled_decode._forward

    def counting(input_ids, positions, metadata):
        batch_sizes.append(input_ids.shape[0])
        return inner(input_ids, positions, metadata)

    runner.compiled_decode._forward = counting
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=generator).tolist() for n in range(3, 27, 3)]
    want, got = _generate(eager, prompts), _generate(compiled, prompts)
    # Larger steps run eagerly on oneDNN's packed weights, in both engines.
    largest = min(runner.compiled_decode.max_batch_size, len(prompts))
    assert sorted(set(batch_sizes)) == list(range(1, largest + 1))
    assert counters["stats"]["unique_graphs"] == graphs_before + 1  # and never again
    _assert_same_bits(want, got)


def test_a_weight_replaced_after_compiling_is_used_without_compiling_again(tiny_llama):
    # The graph does not guard on the model's modules, so nothing would notice a stale
    # weight: the parameters must be read afresh at every step.
    eager, compiled = small_engine(tiny_llama), small_engine(tiny_llama, compile=True)
    graphs_before = counters["stats"]["unique_graphs"]
    for llm in (eager, compiled):
        norm = model_runner(llm).model.model.norm
        norm.weight = torch.nn.Parameter(norm.weight * 1.5, requires_grad=False)
    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    want, got = _generate(eager, prompts), _generate(compiled, prompts)
    assert counters["stats"]["unique_graphs"] == graphs_before
    _assert_same_bits(want, got)
    unchanged = _generate(small_engine(tiny_llama), prompts)
    assert [o.logprobs for o in unchanged] != [o.logprobs for o in got]  # the change showed


def test_two_models_of_one_class_in_one_process_each_run_their_own_graph(tiny_llama):
    # The graph does not guard on the model's modules, so a graph kept for the class's
    # forward would serve a second model of that class: here one whose KV cache is int8,
    # which the first model's graph writes without the scales it needs.
    first = small_engine(tiny_llama, compile=True)
    graphs_before = counters["stats"]["unique_graphs"]
    second = small_engine(tiny_llama, compile=True, kv_cache_dtype="int8")
    assert model_runner(second).compiled_decode is not None
    assert counters["stats"]["unique_graphs"] == graphs_before + 1
    eager = small_engine(tiny_llama, kv_cache_dtype="int8")
    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    assert [o.token_ids for o in _generate(second, prompts)] == [
        o.token_ids for o in _generate(eager, prompts)
    ]
    assert _generate(first, prompts)  # the first model's graph still runs


def test_inductor_cache_goes_under_pagedllm_cache_dir(monkeypatch, tmp_path):
    from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir

    from pagedllm.runner.compiled_forward import _use_pagedllm_cache

    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    # What importing torch._dynamo leaves behind: torch's default, written in.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    _use_pagedllm_cache()
    assert cache_dir() == str(tmp_path / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "chosen"))  # the user's
    _use_pagedllm_cache()
    assert cache_dir() == str(tmp_path / "chosen")


def test_compiled_decode_leaves_prefill_and_large_batches_eager(tiny_llama):
    from pagedllm.runner.compiled_forward import CompiledDecode

    compiled = CompiledDecode(model_runner(small_engine(tiny_llama)).model, max_batch_size=3)
    assert compiled.applies(torch.ones(3, dtype=torch.int64).numpy())
    assert not compiled.applies(torch.ones(4, dtype=torch.int64).numpy())
    assert not compiled.applies(torch.tensor([1, 5, 1]).numpy())
    model = model_runner(small_engine(tiny_llama)).model
    assert CompiledDecode(model, 10**6).max_batch_size == MAX_BATCH_SIZE


def test_packed_weights_leave_the_compiled_graph_the_small_steps(tiny_llama, monkeypatch):
    compiled = model_runner(small_engine(tiny_llama, compile=True)).compiled_decode
    assert compiled.max_batch_size == fused.PACKED_MIN_ROWS - 1
    monkeypatch.setenv("PAGEDLLM_ONEDNN", "0")  # no packed weights: the skinny kernel's range
    runner = model_runner(small_engine(tiny_llama, compile=True))
    assert runner.compiled_decode.max_batch_size == MAX_BATCH_SIZE


def test_compile_needs_the_cpu_backend(tiny_llama, caplog):
    llm = small_engine(tiny_llama, compile=True, attention_backend="torch")
    assert model_runner(llm).compiled_decode is None
    assert "decode steps stay eager" in caplog.text


# Where the default stays eager (each case before any tracing: no graph is compiled).
DEFAULT_EAGER_CASES = {
    "bf16": ({"dtype": "bfloat16"}, "dtype torch.bfloat16"),
    "int8": ({"quantization": "int8"}, "quantization='int8'"),
    "torch-attention": ({"attention_backend": "torch"}, "attention_backend='torch'"),
    "no-compiler": ({}, "no C++ compiler"),
    "suite": ({}, "PAGEDLLM_COMPILE=0"),
}


@pytest.mark.parametrize("case", DEFAULT_EAGER_CASES)
def test_the_default_stays_eager_where_compiling_is_not_exact(
    tiny_llama, case, monkeypatch, caplog
):
    engine_args, why = DEFAULT_EAGER_CASES[case]
    if case != "suite":
        monkeypatch.delenv("PAGEDLLM_COMPILE")
    if case == "no-compiler":
        monkeypatch.setattr(compile_choice, "has_cpp_compiler", lambda: False)
    graphs_before = counters["stats"]["unique_graphs"]
    llm = small_engine(tiny_llama, **engine_args)
    assert model_runner(llm).compiled_decode is None
    assert counters["stats"]["unique_graphs"] == graphs_before
    assert f"Decode steps run eagerly: {why}" in caplog.text
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    assert len(llm.generate([{"prompt_token_ids": [5, 6]}], params)[0].outputs[0].token_ids) == 3


def test_the_default_leaves_other_devices_eager(monkeypatch):
    # No accelerator here: the choice itself, on the engine config a CUDA engine would have.
    monkeypatch.delenv("PAGEDLLM_COMPILE")
    config = SimpleNamespace(
        device="cuda:0",
        attention_backend="cpu",
        parallel_config=SimpleNamespace(world_size=1),
        pooler_config=None,
        speculative_config=None,
        model_config=SimpleNamespace(dtype=torch.float32, quantization=None),
    )
    assert compile_choice.eager_reason(config, traceable=True).startswith("device='cuda:0'")


def test_compile_and_enforce_eager_exclude_each_other():
    with pytest.raises(ValueError, match="exclude each other"):
        EngineArgs(compile=True, enforce_eager=True)


def test_compile_flags_use_vllm_names():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_args_from(parser.parse_args([])).compile is None  # the engine decides
    assert engine_args_from(parser.parse_args(["--no-compile"])).compile is False
    args = engine_args_from(parser.parse_args(["--compile"]))
    assert args.compile and not args.enforce_eager
    args = engine_args_from(parser.parse_args(["--enforce-eager"]))
    assert args.enforce_eager and not args.compile


def test_a_model_compile_cannot_trace_runs_eagerly(tiny_llama, caplog):
    # int8's fbgemm weights are script objects that torch.compile does not trace.
    llm = small_engine(tiny_llama, compile=True, quantization="int8")
    assert model_runner(llm).compiled_decode is None
    assert "compile failed" in caplog.text
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate([{"prompt_token_ids": [5, 6, 7]}], params)[0].outputs[0].token_ids) == 4


@pytest.mark.slow  # long: a second compile
def test_compiled_decode_serves_several_kv_cache_groups(tiny_model_factory):
    """A model with a full and a windowed group: one graph takes both groups' metadata, and
    its tokens equal the eager forward's as the window moves past the prompts."""
    directory = tiny_model_factory("Qwen2ForCausalLM:hybrid24")
    eager = small_engine(directory)
    graphs_before = counters["stats"]["unique_graphs"]
    compiled = small_engine(directory, compile=True)
    assert model_runner(compiled).num_kv_groups == 2
    assert counters["stats"]["unique_graphs"] == graphs_before + 1
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (n,), generator=generator).tolist() for n in (5, 20, 30)]
    want, got = _generate(eager, prompts), _generate(compiled, prompts)
    assert counters["stats"]["unique_graphs"] == graphs_before + 1
    for a, b in zip(want, got, strict=True):
        assert a.token_ids == b.token_ids
