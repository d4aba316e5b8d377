"""Does a mixture of experts decode at the speed of its active parameters?

Three random-weight models (`load_format="dummy"`, fp32) with the same attention, head and
layer count: a Mixtral-shaped MoE (`--experts` experts of `--expert-size`, top `--top-k`),
a dense Llama whose MLP equals the MoE's active experts (intermediate = top_k x
expert_size) and one whose MLP equals all of them (experts x expert_size). For each it
captures one real decode step of a single request and one `--prompt-len` prefill, then
times the model's forward on them (median of `--calls` calls), rounds interleaved over the
models so that the machine's drift hits all alike. The prediction: time per token in
proportion to the parameters a token reads (attention, router, the experts it is routed to
or the dense MLP, and the head; the embedding lookup reads one row).

    .venv/bin/python -m benchmarks.moe_vs_dense [--hidden 1024] [--expert-size 1024]
        [--experts 8] [--top-k 2] [--layers 4] [--prompt-len 512] [--rounds 7] [--calls 10]
        [--threads 2] [--output-json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.model.loader import write_config_dir
from pagedllm.runner.model_runner import ForwardStep

VOCAB = 8192
HEAD_DIM = 64


def base_config(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "vocab_size": VOCAB,
        "hidden_size": args.hidden,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.hidden // HEAD_DIM,
        "num_key_value_heads": max(1, args.hidden // HEAD_DIM // 4),
        "head_dim": HEAD_DIM,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def model_configs(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """name -> config.json fields of the three models."""
    base = base_config(args)
    moe = {
        **base,
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "intermediate_size": args.expert_size,
        "num_local_experts": args.experts,
        "num_experts_per_tok": args.top_k,
        "sliding_window": None,
    }
    llama = {**base, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    return {
        "moe": moe,
        "dense-active": {**llama, "intermediate_size": args.top_k * args.expert_size},
        "dense-all": {**llama, "intermediate_size": args.experts * args.expert_size},
    }


def params_per_token(config: dict[str, Any]) -> tuple[int, int]:
    """(all parameters but the embedding, those one token reads)."""
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    attention = hidden * (2 * q + 2 * kv) + 2 * hidden  # q, o, k, v and the two norms
    mlp = 3 * hidden * config["intermediate_size"]
    head = config["vocab_size"] * hidden + hidden
    experts = config.get("num_local_experts")
    if experts is None:
        per_layer = attention + mlp
        return layers * per_layer + head, layers * per_layer + head
    router = experts * hidden
    total = layers * (attention + router + experts * mlp) + head
    active = layers * (attention + router + config["num_experts_per_tok"] * mlp) + head
    return total, active


def capture_steps(llm: LLM, prompt_len: int) -> tuple[tuple, tuple]:
    """(prefill step, decode step) inputs (input_ids, positions, metadata) of one request."""
    steps: list[ForwardStep] = []
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompt = [(7 * i + 3) % VOCAB for i in range(prompt_len)]
    with llm.model_runner.forward_observer(steps.append):
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return steps[0].model_inputs, steps[-1].model_inputs


def median_ms(model: torch.nn.Module, step: tuple, calls: int) -> float:
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        model(*step)
        times.append(1000 * (time.perf_counter() - started))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--expert-size", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output-json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    configs = model_configs(args)
    models, steps = {}, {}
    with tempfile.TemporaryDirectory() as root:
        for name, config in configs.items():
            llm = LLM(
                write_config_dir(f"{root}/{name}", config),
                load_format="dummy",
                skip_tokenizer_init=True,
                dtype="float32",
                max_model_len=args.prompt_len + 16,
                max_num_batched_tokens=max(2048, args.prompt_len),
                kv_cache_memory="64MiB",
                disable_log_stats=True,
            )
            models[name] = (llm, llm.model_runner.model)  # the LLM keeps the KV cache alive
            steps[name] = capture_steps(llm, args.prompt_len)
    rounds: dict[str, dict[str, list[float]]] = {n: {"prefill": [], "decode": []} for n in models}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for name, (_, model) in models.items():
                prefill, decode = steps[name]
                rounds[name]["prefill"].append(median_ms(model, prefill, max(2, args.calls // 5)))
                rounds[name]["decode"].append(median_ms(model, decode, args.calls))
    report(args, configs, rounds)


def report(args, configs, rounds) -> None:
    results = {}
    moe_active = params_per_token(configs["moe"])[1]
    moe = {phase: statistics.median(rounds["moe"][phase]) for phase in ("prefill", "decode")}
    print(
        f"{args.threads} threads; hidden {args.hidden}, {args.layers} layers, "
        f"{args.experts} experts of {args.expert_size} (top {args.top_k}); "
        f"prefill {args.prompt_len} tokens"
    )
    print(
        "| model | params (M, no embedding) | read per token (M) | decode ms/token "
        "| prefill ms/token | MoE / this, decode | MoE / this, prefill | predicted |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, config in configs.items():
        total, active = params_per_token(config)
        decode = statistics.median(rounds[name]["decode"])
        prefill = statistics.median(rounds[name]["prefill"]) / args.prompt_len
        predicted = moe_active / active
        row = {
            "params": total,
            "active_params": active,
            "decode_ms": decode,
            "prefill_ms_per_token": prefill,
            "moe_over_this_decode": moe["decode"] / decode,
            "moe_over_this_prefill": moe["prefill"] / args.prompt_len / prefill,
            "predicted": predicted,
            "decode_rounds_ms": rounds[name]["decode"],
        }
        results[name] = row
        print(
            f"| {name} | {total / 1e6:.1f} | {active / 1e6:.1f} | {decode:.2f} "
            f"| {prefill:.3f} | {row['moe_over_this_decode']:.2f} "
            f"| {row['moe_over_this_prefill']:.2f} | {predicted:.2f} |"
        )
    if args.output_json:
        args.output_json.write_text(
            json.dumps({"args": vars(args) | {"output_json": None}, "results": results}, indent=2)
        )


if __name__ == "__main__":
    main()
