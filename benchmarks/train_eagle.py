"""Distil an EAGLE-3 head for the default model (SmolLM2-135M-Instruct) on this CPU and
write it to a cache directory, loadable as
`speculative_config={"method": "eagle3", "model": DIR, "num_speculative_tokens": k}`.

Phases, each timed: prompts generated here (eagle_train/prompts.py); the target's greedy
generations with pagedllm, the layers the head reads kept during the same forwards
(eagle_train/capture.py); a draft vocabulary of the generations' most frequent tokens
(vocab.py); training with training-time test (head_model.py, loop.py); the directory in
the published layout (export.py). `--minutes` bounds the whole run: training stops when
its share is spent. DIR is an artefact, never committed. On a shared machine run it with
OMP_NUM_THREADS=1 (results/spec_decode.md: two threads under load decoded ~12x slower).

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.train_eagle --out DIR
        [--num-prompts 512] [--held-out-prompts 32] [--max-tokens 96] [--data-minutes 7]
        [--steps 1200] [--minutes 26]
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from dataclasses import asdict
from pathlib import Path

import torch

from benchmarks.eagle_train.acceptance import replayed_acceptance
from benchmarks.eagle_train.capture import Sequence, generate_with_states
from benchmarks.eagle_train.dataset import make_batches, split
from benchmarks.eagle_train.export import write_head_dir
from benchmarks.eagle_train.head_model import HeadSizes, TrainableEagle3Head
from benchmarks.eagle_train.loop import (
    TrainSettings,
    cpu_has_bf16,
    evaluate,
    expected_acceptance,
    train,
)
from benchmarks.eagle_train.prompts import make_prompts
from benchmarks.eagle_train.vocab import DraftVocab, most_frequent
from pagedllm import LLM
from pagedllm.model.layers.rotary import rope_parameters
from pagedllm.spec_decode.head_layers import default_aux_layers

# Kept for evaluation, out of the training batches.
HELD_OUT = 0.05
# What the export and the held-out evaluation are left of the budget.
FINISH_MARGIN_S = 45.0


class TargetParts:
    """What training reads of the target once its generations are done: its config, its
    embedding, final norm and lm_head (copies: the engine is dropped before training)."""

    def __init__(self, llm: LLM) -> None:
        model = llm.model_runner.model
        self.config = model.config
        self.embedding = model.model.embed_tokens.weight.detach().float().clone()
        self.final_norm = model.model.norm.weight.detach().float().clone()
        lm_head = getattr(model.lm_head, "weight", None)
        plain = lm_head is not None and tuple(lm_head.shape) == tuple(self.embedding.shape)
        self.lm_head = lm_head.detach().float().clone() if plain else self.embedding


def head_sizes(config, num_states: int, draft_vocab: int) -> HeadSizes:
    head_dim = getattr(config, "head_dim", None) or (
        config.hidden_size // config.num_attention_heads
    )
    return HeadSizes(
        hidden=config.hidden_size,
        intermediate=config.intermediate_size,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=head_dim,
        num_target_states=num_states,
        draft_vocab=draft_vocab,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=float(rope_parameters(config)["rope_theta"]),
    )


def new_head(target: TargetParts, layers: tuple[int, ...], vocab: DraftVocab, seed: int):
    torch.manual_seed(seed)
    head = TrainableEagle3Head(
        head_sizes(target.config, len(layers), len(vocab.target_ids)), target.embedding
    )
    head.init_from_target(target.lm_head[vocab.target_ids], target.final_norm, len(layers) - 1)
    return head


def generated_tokens(sequences: list[Sequence]) -> list[list[int]]:
    return [s.token_ids[s.prompt_len :] for s in sequences]


def distil(
    sequences: list[Sequence],
    target: TargetParts,
    layers: tuple[int, ...],
    out: Path,
    settings: TrainSettings,
    draft_vocab: int,
    batch_tokens: int,
    deadline: float,
    max_len: int = 1024,
    num_speculative_tokens: int = 3,
    max_output_tokens: int | None = None,
    held_out: list[Sequence] | None = None,
) -> dict:
    """Train on `sequences` and write the head to `out`; what was measured on the way, on
    `held_out` (by default a seeded share of `sequences`, kept out of training)."""
    if held_out is None:
        train_set, held_out = split(sequences, HELD_OUT, settings.seed)
    else:
        train_set = sequences
    vocab = most_frequent(generated_tokens(train_set), draft_vocab, target.config.vocab_size)
    draft_ids = vocab.draft_ids()
    batches = make_batches(train_set, draft_ids, batch_tokens, max_len)
    eval_batches = make_batches(held_out, draft_ids, batch_tokens, max_len)
    generated = sum(len(t) for t in generated_tokens(train_set))
    covered = sum(
        int((draft_ids[torch.tensor(t)] >= 0).sum()) for t in generated_tokens(train_set) if t
    )
    print(
        f"data: {len(train_set)} sequences ({generated} generated tokens, "
        f"{covered / max(1, generated):.1%} in the draft vocabulary of {draft_vocab}), "
        f"{len(batches)} batches; {len(held_out)} held out",
        flush=True,
    )
    head = new_head(target, layers, vocab, settings.seed)
    started = time.monotonic()
    steps_run = train(head, batches, settings, deadline)
    train_s = time.monotonic() - started
    accuracies = (
        evaluate(head, eval_batches, settings.ttt_steps, settings.bf16) if eval_batches else []
    )
    report = {
        "layers": list(layers),
        "draft_vocab_size": draft_vocab,
        "draft_vocab_coverage": covered / max(1, generated),
        "train_sequences": len(train_set),
        "train_generated_tokens": generated,
        "steps_run": steps_run,
        "train_seconds": train_s,
        "held_out_accuracy_per_step": accuracies,
        "settings": asdict(settings),
    }
    if accuracies:
        report["estimated_acceptance_length"] = expected_acceptance(
            accuracies, num_speculative_tokens
        )
        # What the engine gets on these sequences (acceptance.py): lower than the estimate.
        replayed = replayed_acceptance(
            head, held_out, draft_ids, num_speculative_tokens, max_output_tokens
        )
        report["replayed_acceptance_length"] = replayed.mean_acceptance_length
    write_head_dir(out, target.config, head, vocab, layers, report)
    return report


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--model", default=None, help="the target (default: the default model)")
    parser.add_argument("--num-prompts", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--data-minutes", type=float, default=7.0, help="no new round after")
    parser.add_argument("--held-out-prompts", type=int, default=32, help="about unseen subjects")
    parser.add_argument("--round-size", type=int, default=32, help="prompts generated at once")
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--minutes", type=float, default=26.0, help="the whole run's budget")
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--ttt-steps", type=int, default=3)
    parser.add_argument("--batch-tokens", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--fp32", action="store_true", help="no bf16 autocast even if the CPU has it"
    )
    return parser.parse_args()


def capture(
    args, data_deadline: float
) -> tuple[list[Sequence], list[Sequence], TargetParts, tuple[int, ...]]:
    """(training sequences, held-out sequences, ...): the target's generations, the held-out
    prompts first, then the training prompts in rounds of `--round-size`, no new round once
    `data_deadline` has passed."""
    llm = LLM(
        args.model,
        max_model_len=2048,
        kv_cache_memory="1GiB",
        enable_prefix_caching=False,
        seed=args.seed,
    )
    target = TargetParts(llm)
    layers = default_aux_layers(target.config.num_hidden_layers)
    tokenizer = llm.get_tokenizer()
    held_out_prompts = make_prompts(tokenizer, args.held_out_prompts, args.seed, held_out=True)
    held_out = generate_with_states(llm, held_out_prompts, layers, args.max_tokens)
    prompts = make_prompts(tokenizer, args.num_prompts, args.seed)
    sequences: list[Sequence] = []
    for start in range(0, len(prompts), args.round_size):
        if time.monotonic() > data_deadline:
            print(f"data: time budget reached after {len(sequences)} prompts", flush=True)
            break
        chunk = prompts[start : start + args.round_size]
        sequences += generate_with_states(llm, chunk, layers, args.max_tokens)
    del llm
    gc.collect()
    return sequences, held_out, target, layers


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    started = time.monotonic()
    deadline = started + args.minutes * 60 - FINISH_MARGIN_S
    sequences, held_out, target, layers = capture(args, started + args.data_minutes * 60)
    data_s = time.monotonic() - started
    print(f"phase data: {data_s:.0f}s, {len(sequences)} sequences, layers {layers}", flush=True)
    settings = TrainSettings(
        steps=args.steps,
        lr=args.lr,
        ttt_steps=args.ttt_steps,
        bf16=cpu_has_bf16() and not args.fp32,
        seed=args.seed,
    )
    print(f"train: bf16 autocast {'on' if settings.bf16 else 'off'}", flush=True)
    report = distil(
        sequences,
        target,
        layers,
        args.out,
        settings,
        args.draft_vocab,
        args.batch_tokens,
        deadline,
        max_output_tokens=args.max_tokens,
        held_out=held_out,
    )
    report.update(data_seconds=data_s, total_seconds=time.monotonic() - started)
    (args.out / "training.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2), flush=True)


if __name__ == "__main__":
    main()
