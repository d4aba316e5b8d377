"""The measurement the MoE storage benchmarks share (benchmarks/packed_moe.py,
benchmarks/gguf_moe.py): their shape flags, the bytes a mixture's experts hold, and
single-stream decode tokens/s of two engines interleaved round by round, printed as one
table."""

from __future__ import annotations

import argparse
import statistics
import time

from pagedllm import LLM, SamplingParams
from pagedllm.model.layers.fused_moe import GroupedExperts


def add_shape_flags(parser: argparse.ArgumentParser) -> None:
    for flag, default in [("--hidden", 1024), ("--experts", 8), ("--top-k", 2),
                          ("--expert-size", 768), ("--layers", 4), ("--tokens", 64),
                          ("--rounds", 5)]:  # fmt: skip
        parser.add_argument(flag, type=int, default=default)


def expert_bytes(llm: LLM, stored_type: type) -> int:
    """Bytes of the experts: `stored_type`'s own count where they stay stored (packed, on
    blocks), their parameters where they were dequantized into `GroupedExperts`."""
    total = 0
    for module in llm.model_runner.model.modules():
        if isinstance(module, stored_type):
            total += module.weight_bytes()
        elif isinstance(module, GroupedExperts):
            total += sum(p.numel() * p.element_size() for p in module.parameters())
    return total


def dummy_engine(config_dir: str) -> LLM:
    """One stream of a config directory's model on random weights (`load_format="dummy"`)."""
    return LLM(config_dir, load_format="dummy", skip_tokenizer_init=True, max_model_len=512,
               max_num_seqs=1, kv_cache_memory="64MiB", disable_log_stats=True)  # fmt: skip


def tokens_per_s(llm: LLM, tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": list(range(3, 11))}], params, use_tqdm=False)
    return tokens / (time.perf_counter() - start)


def interleaved_rounds(engines: dict[str, LLM], args: argparse.Namespace) -> dict[str, list]:
    """name -> decode tokens/s of each of `args.rounds` rounds, the engines taking turns
    within a round so that drift in the machine falls on both alike."""
    for llm in engines.values():
        tokens_per_s(llm, 8)  # warm-up
    rounds = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            rounds[name].append(tokens_per_s(llm, args.tokens))
    return rounds


def print_table(engines: dict[str, LLM], rounds: dict[str, list], stored_type: type) -> None:
    print("| experts | expert bytes (MB) | decode tok/s (median) | rounds |")
    print("|---|---|---|---|")
    for name, llm in engines.items():
        values = ", ".join(f"{v:.1f}" for v in rounds[name])
        print(
            f"| {name} | {expert_bytes(llm, stored_type) / 1e6:.1f} | "
            f"{statistics.median(rounds[name]):.1f} | {values} |"
        )
