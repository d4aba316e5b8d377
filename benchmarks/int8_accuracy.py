"""Accuracy cost of `quantization="int8"` on the default model (SmolLM2-135M-Instruct).

    .venv/bin/python -m benchmarks.int8_accuracy [--max-tokens 64] [--variants int8,gguf]
                                                 [--output-json out.json]

On 32 fixed prompts (16 chat, through the model's chat template, and 16 plain text) the
fp32 engine decodes greedily (ignore_eos, so every sequence has `--max-tokens` positions).
Each quantized variant then

* decodes greedily too: token agreement with fp32 position by position, overall, and up to
  the first divergence (the common prefix, as a share of the sequence);
* scores fp32's sequences teacher-forced (`prompt_logprobs=0` on prompt + fp32 output):
  the share of positions where fp32's token is still its top-1, and the mean absolute
  difference between its logprob of each fp32 token and fp32's own.

Variants (all but the first patched in here only, to show what the engine's choices buy):
`int8` the engine's (every Linear and the tied head int8, per-token activation scales);
`int8/fp32head` the head left fp32; `int8/tensor` fbgemm's per-tensor activation
quantization without the per-token scaling; `w8-only` the int8 weights dequantized with
fp32 activations, i.e. what the weights alone cost; `gguf` the file's own Q4_1/Q8_0 blocks
with two int8 digits per activation (`quantization="gguf"`), and `gguf/1digit` the same with
one digit; `gguf/kv-fp16` gguf with an fp16 KV cache.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedllm import LLM, SamplingParams
from pagedllm.model.layers.gguf_linear import GGUFLinear
from pagedllm.model.layers.quantization import Int8Linear, quantize_model

CHAT = [
    "What is the capital of France?",
    "Explain photosynthesis in two sentences.",
    "Write a haiku about autumn leaves.",
    "How do I reverse a list in Python?",
    "Give me three tips for sleeping better.",
    "What is the difference between a virus and a bacterium?",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet.",
    "What are the main causes of inflation?",
    "Suggest a name for a small coffee shop.",
    "How many legs does a spider have, and why?",
    "Write a short email asking my manager for a day off.",
    "What is a prime number? Give examples.",
    "Describe the water cycle for a ten-year-old.",
    "What should I pack for a weekend hiking trip?",
]
PLAIN = [
    "The history of the Roman Empire began",
    "def fibonacci(n):\n    ",
    "In a small village at the edge of the forest, there lived",
    "The three laws of thermodynamics state that",
    "Once upon a time, a curious robot named",
    "The stock market closed higher today as investors",
    "To bake a loaf of bread, first",
    "Machine learning is a field of computer science that",
    "The Amazon rainforest is home to",
    "Dear Sir or Madam,\n\nI am writing to",
    "The most important invention of the twentieth century was",
    "SELECT name, age FROM users WHERE",
    "The planet Mars has two moons,",
    "Water boils at 100 degrees Celsius because",
    "Chapter 1\n\nIt was a cold morning in December when",
    "The recipe calls for two cups of flour,",
]


def prompts(tokenizer) -> list[list[int]]:
    """Token ids of the chat prompts (rendered by the chat template) then the plain ones."""
    chat = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        for text in CHAT
    ]
    # The template already holds its special tokens.
    return [tokenizer.encode(text, add_special_tokens=False) for text in chat] + [
        tokenizer.encode(text) for text in PLAIN
    ]


def greedy(llm: LLM, token_prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in token_prompts]
    return [list(o.outputs[0].token_ids) for o in llm.generate(batch, params, use_tqdm=False)]


def teacher_forced(llm: LLM, token_prompts, sequences) -> list[list[tuple[float, int]]]:
    """(logprob, rank) under `llm` of each token of each sequence, after its prompt."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    batch = [{"prompt_token_ids": p + s} for p, s in zip(token_prompts, sequences, strict=True)]
    scored = []
    for output, prompt in zip(
        llm.generate(batch, params, use_tqdm=False), token_prompts, strict=True
    ):
        positions = output.prompt_logprobs[len(prompt) :]
        tokens = output.prompt_token_ids[len(prompt) :]
        scored.append(
            [(pos[t].logprob, pos[t].rank) for pos, t in zip(positions, tokens, strict=True)]
        )
    return scored


def _model(llm: LLM):
    return llm.model_runner.model


def fp32_head(llm: LLM) -> None:
    """int8 everywhere but the head: `llm` is an fp32 engine, quantized here."""
    quantize_model(_model(llm), "int8", quantize_head=False)


def per_tensor_activations(llm: LLM) -> None:
    """fbgemm's own dynamic quantization alone: one scale for the whole batch."""
    for layer in _int8_layers(llm):

        def forward(x, layer=layer):
            out = torch.ops.quantized.linear_dynamic(x, layer._packed, layer.reduce_range)
            return out if layer.bias is None else out + layer.bias

        object.__setattr__(layer, "forward", forward)


def weights_only(llm: LLM) -> None:
    """int8 weights dequantized, fp32 activations: what the weights alone cost."""
    for layer in _int8_layers(llm):
        weight, bias = layer.unpack()
        weight = weight.dequantize()
        object.__setattr__(layer, "forward", lambda x, w=weight, b=bias: F.linear(x, w, b))


def one_digit(llm: LLM) -> None:
    """`gguf` with one int8 digit per activation instead of two."""
    for layer in _model(llm).modules():
        if isinstance(layer, GGUFLinear):
            layer.digits = 1


def _int8_layers(llm: LLM) -> list[Int8Linear]:
    return [m for m in _model(llm).modules() if isinstance(m, Int8Linear)]


# Variant name -> (the engine's quantization argument, what is patched into it, or None).
VARIANTS = {
    "int8": ("int8", None),
    "int8/fp32head": (None, fp32_head),
    "int8/tensor": ("int8", per_tensor_activations),
    "w8-only": ("int8", weights_only),
    "gguf": ("gguf", None),
    "gguf/1digit": ("gguf", one_digit),
    "gguf/kv-fp16": ("gguf", None),
}
# Variants that also store the KV cache in 16 bits (kv_cache_dtype).
KV_CACHE_DTYPES = {"gguf/kv-fp16": "float16"}


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict:
    same = total = 0
    prefixes = []
    for ref, seq in zip(reference, other, strict=True):
        matches = [a == b for a, b in zip(ref, seq, strict=True)]
        same += sum(matches)
        total += len(matches)
        prefixes.append(matches.index(False) if False in matches else len(matches))
    length = len(reference[0])
    return {
        "overall": same / total,
        "prefix_share": statistics.mean(prefixes) / length,
        "prefix_median": statistics.median(prefixes),
        "identical_sequences": sum(p == length for p in prefixes),
    }


def logprob_stats(reference, scored) -> dict:
    diffs = [
        abs(a[0] - b[0])
        for ref_seq, seq in zip(reference, scored, strict=True)
        for a, b in zip(ref_seq, seq, strict=True)
    ]
    top1 = [b[1] == 1 for seq in scored for b in seq]
    return {
        "teacher_forced_top1": sum(top1) / len(top1),
        "mean_abs_logprob_diff": statistics.mean(diffs),
        "max_abs_logprob_diff": max(diffs),
    }


def print_table(results: dict, num_prompts: int, max_tokens: int) -> None:
    print(f"\n{num_prompts} prompts x {max_tokens} greedy tokens, fp32 is the reference")
    columns = ["overall", "prefix_share", "prefix_median", "identical_sequences"]
    columns += ["teacher_forced_top1", "mean_abs_logprob_diff", "max_abs_logprob_diff"]
    print(f"{'variant':14s} " + "  ".join(f"{c:>21s}" for c in columns))
    for name, row in results.items():
        cells = [
            f"{row[c]:21.4f}" if isinstance(row[c], float) else f"{row[c]:21d}" for c in columns
        ]
        print(f"{name:14s} " + "  ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated")
    args = parser.parse_args()
    common = dict(model=args.model, max_model_len=1024, disable_log_stats=True)
    fp32 = LLM(**common)
    token_prompts = prompts(fp32.get_tokenizer())
    reference = greedy(fp32, token_prompts, args.max_tokens)
    reference_scores = teacher_forced(fp32, token_prompts, reference)
    del fp32
    results = {}
    for name in args.variants.split(","):
        quantization, patch = VARIANTS[name]
        kv_cache_dtype = KV_CACHE_DTYPES.get(name, "auto")
        llm = LLM(**common, quantization=quantization, kv_cache_dtype=kv_cache_dtype)
        if patch is not None:
            patch(llm)
        row = agreement(reference, greedy(llm, token_prompts, args.max_tokens))
        row |= logprob_stats(reference_scores, teacher_forced(llm, token_prompts, reference))
        results[name] = row
        del llm
    print_table(results, len(token_prompts), args.max_tokens)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
