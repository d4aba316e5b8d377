"""Helpers for tests that compare pagedllm with Hugging Face Transformers on the same weights."""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

# Small enough to build and run in well under a second; odd sizes catch shape slips.
TINY_CONFIGS = {
    "LlamaForCausalLM": dict(model_type="llama", head_dim=16),
    "Qwen2ForCausalLM": dict(model_type="qwen2"),
    "MistralForCausalLM": dict(model_type="mistral", sliding_window=None, head_dim=16),
    "Qwen3ForCausalLM": dict(model_type="qwen3", head_dim=16),
    # Local (window 24, shorter than most test prompts) and global layers with RoPE bases
    # of their own, the global one linearly scaled; a score scale that is not head_dim's;
    # soft-capped logits. Untied: the sharpened head tied to the embedding would drown the
    # layers' outputs in the residual stream (tests/model/test_gemma3.py ties it).
    "Gemma3ForCausalLM": dict(
        model_type="gemma3_text",
        head_dim=16,
        num_hidden_layers=3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=24,
        query_pre_attn_scalar=24,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
        },
        final_logit_softcapping=50.0,
    ),
    # Fused qkv/gate_up checkpoint; a window (Phi-3-mini-4k's is 2047) shorter than the longest
    # prompts, yet long enough that the shared test's KV budget still forces preemption;
    # Phi-3's default pad id (32000) would lie outside the tiny vocabulary. Weights 5x the
    # default scale make attention peaked enough that RoPE details (LongRoPE's factors and
    # cos/sin scale) change greedy tokens; at 0.02 attention is near uniform and they do not.
    "Phi3ForCausalLM": dict(
        model_type="phi3",
        sliding_window=200,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.1,
    ),
    "MixtralForCausalLM": dict(
        model_type="mixtral", head_dim=16, num_local_experts=4, num_experts_per_tok=2
    ),
    # Three layers, the middle one dense (mlp_only_layers), as Qwen3-30B-A3B renormalizes.
    "Qwen3MoeForCausalLM": dict(
        model_type="qwen3_moe",
        head_dim=16,
        num_hidden_layers=3,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=[1],
    ),
}


def make_tiny_model(architecture: str, directory: Path, **overrides) -> Path:
    """Save a tiny random model of `architecture` (and a tokenizer-free dir) to `directory`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": False,
        **TINY_CONFIGS[architecture],
        **overrides,
    }
    model_type = settings.pop("model_type")
    config = AutoConfig.for_model(model_type, architectures=[architecture], **settings)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init is too flat for greedy decoding to be interesting; sharpen the head.
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    model.save_pretrained(directory)
    make_tiny_tokenizer().save_pretrained(directory)
    return directory


def make_tiny_tokenizer():
    """A byte-level BPE tokenizer of ~300 tokens with a chat template; ids fit the tiny vocab."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ["The quick brown fox jumps over the lazy dog. What is the capital of France?"] * 4
    tokenizer.train_from_iterator(corpus, trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    wrapped.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant:{% endif %}"
    )
    return wrapped


@dataclass
class GreedyReference:
    token_ids: list[int]
    top2_gaps: list[float]  # logit gap between the best two tokens at each generated position


def hf_greedy(model, prompt_token_ids: list[int], max_new_tokens: int) -> GreedyReference:
    """Greedy continuation by Transformers `generate`, ignoring EOS, with per-step logit gaps."""
    input_ids = torch.tensor([prompt_token_ids])
    with torch.no_grad():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            eos_token_id=None,
            pad_token_id=0,
        )
    tokens = out.sequences[0, len(prompt_token_ids) :].tolist()
    gaps = []
    for logits in out.logits:
        top2 = logits[0].float().topk(2).values
        gaps.append(float(top2[0] - top2[1]))
    return GreedyReference(tokens, gaps)


def cached_hf_greedy(
    model_file: str, prompts: list[list[int]], max_new_tokens: int, load: Callable[[], Any]
) -> list[GreedyReference]:
    """`hf_greedy` of Transformers' model on a real model's file (`load()` builds it) for
    each prompt, computed once and then read from pagedllm's cache root (never the
    repository): such references take minutes on two cores. The key is a digest of the
    file's bytes, the prompts, `max_new_tokens`, the Transformers and torch versions and
    `hf_greedy`'s source, so a change to any of them computes them again."""
    import transformers

    from pagedllm.utils import cache_root

    with open(model_file, "rb") as file:
        file_digest = hashlib.file_digest(file, "sha256").hexdigest()
    key = {
        "model": file_digest,
        "prompts": prompts,
        "max_new_tokens": max_new_tokens,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "hf_greedy": inspect.getsource(hf_greedy),
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    path = cache_root() / "test-references" / f"{digest}.json"
    if path.is_file():
        return [GreedyReference(**reference) for reference in json.loads(path.read_text())]
    model = load()
    references = [hf_greedy(model, prompt, max_new_tokens) for prompt in prompts]
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_suffix(f".tmp-{os.getpid()}")
    staging.write_text(json.dumps([asdict(reference) for reference in references]))
    os.replace(staging, path)  # a concurrent reader sees the whole file or none
    return references


def compare_greedy(actual: list[int], reference: GreedyReference, tie_tolerance: float) -> int:
    """Assert `actual` equals the reference up to the first numerical tie; 1 if it met one.

    At a tie (top two logits within `tie_tolerance`) either token is acceptable and the
    continuations legitimately diverge, so comparison stops there.
    """
    for position, (got, want) in enumerate(zip(actual, reference.token_ids, strict=False)):
        if got == want:
            continue
        gap = reference.top2_gaps[position]
        assert gap <= tie_tolerance, (
            f"token {position}: got {got}, expected {want} (top-2 gap {gap:.2e} is not a tie)\n"
            f"actual   {actual}\nexpected {reference.token_ids}"
        )
        return 1
    assert len(actual) == len(reference.token_ids), (
        f"{len(actual)} != {len(reference.token_ids)} tokens"
    )
    return 0


@contextlib.contextmanager
def torch_threads(num_threads: int) -> Iterator[None]:
    """torch's thread pool sized `num_threads` inside the block, restored after it."""
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def greedy_with_logprobs(llm, prompts: list[list[int]], max_tokens: int) -> list:
    """Each prompt's greedy completion (EOS ignored), with the top-2 logprobs of every step."""
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    batch = [{"prompt_token_ids": p} for p in prompts]
    return [o.outputs[0] for o in llm.generate(batch, params, use_tqdm=False)]


def compare_to_reference_engine(reference: list, actual: list, tie_tolerance: float):
    """(ties, largest |logprob difference| of the chosen tokens) of `actual` against
    `reference` completions (from `greedy_with_logprobs`). A different token is allowed only
    where the reference's top two logprobs are within `tie_tolerance`; a sequence is compared
    up to its first tie."""
    ties, largest = 0, 0.0
    for want, got in zip(reference, actual, strict=True):
        for position, (a, b) in enumerate(zip(want.token_ids, got.token_ids, strict=True)):
            top = sorted(want.logprobs[position].values(), key=lambda lp: -lp.logprob)
            if a != b:
                gap = top[0].logprob - top[1].logprob
                assert gap <= tie_tolerance, f"position {position}: gap {gap:.2e} is no tie"
                ties += 1
                break
            largest = max(largest, abs(got.logprobs[position][b].logprob - top[0].logprob))
    return ties, largest


def assert_bit_equal_to_reference(reference: list, actual: list, report_ties) -> None:
    """`actual` completions are `reference`'s to the bit: the same tokens (no tie taken the
    other way) and the same top-2 logprobs at every step, as one rank's layout gives."""
    ties, largest = compare_to_reference_engine(reference, actual, 1e-4)
    report_ties(ties, len(actual))
    assert (ties, largest) == (0, 0.0)
    for want, got in zip(reference, actual, strict=True):
        assert [_logprob_values(step) for step in got.logprobs] == [
            _logprob_values(step) for step in want.logprobs
        ]


def _logprob_values(step: dict) -> dict[int, float]:
    return {token: logprob.logprob for token, logprob in step.items()}


def small_engine(directory, **engine_args):
    """An `LLM` on a tiny model with a small context and cache (8 MiB)."""
    from pagedllm import LLM

    return LLM(str(directory), max_model_len=256, kv_cache_memory="8MiB", **engine_args)


def model_runner(llm):
    """The engine's `ModelRunner` (the offline `LLM` runs the core in its own process)."""
    return llm.model_runner


# Repeated patterns (speculation's proposers find them) beside plain ones, of 8 to 40 tokens.
MIXED_PROMPTS = [
    [5, 6, 7, 8] * 6,
    list(range(100, 140)),
    [3, 200, 7, 90, 45, 300, 12, 8],
    [9, 10, 11] * 7,
    list(range(300, 330)),
    [42, 43] * 12,
]


def run_tenants(llm, requests: list[tuple], samples: bool = False, max_steps: int = 5000) -> list:
    """Run `(request id, tenant, prompt token ids, SamplingParams, LoRARequest | None)`
    requests on `llm`'s engine to the end (several tenants share it, as the server's do);
    each request's completion (`samples`: the list of its n samples), in the order given."""
    import dataclasses

    from pagedllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    for request_id, tenant, prompt, params, lora in requests:
        final = dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
        engine.add_request(
            request_id, {"prompt_token_ids": prompt}, final, tenant=tenant, lora_request=lora
        )
    finished = {}
    for _ in range(max_steps):
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs if samples else output.outputs[0]
        if not engine.has_unfinished_requests():
            return [finished[request[0]] for request in requests]
    raise AssertionError(f"not finished in {max_steps} steps")
