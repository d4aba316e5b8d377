"""Run a function on N ranks (spawned processes, gloo on 127.0.0.1) and collect what each returns.

Every wait is bounded; a rank that raises or dies fails the run at once with its traceback
or exit code, and every process started is killed and reaped before `run_ranks` returns.
Also: tiny Llama-shaped configs and their checkpoint tensors (HF names, seeded), and one
step runner that drives a model through prefill and decode on every rank, pipeline
send/recv included.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from process_guard import die_with_parent

from pagedllm.ops.attention import AttentionLayout
from pagedllm.utils import free_port


def _entry(target, rank, world_size, port, results, timeout_s, env, args, parent) -> None:
    die_with_parent(parent)  # a rank waiting in a collective must not outlive pytest
    os.environ.update(env)
    torch.set_num_threads(1)
    from pagedllm.distributed import parallel_state

    try:
        parallel_state.init_distributed_environment(
            world_size, rank, f"tcp://127.0.0.1:{port}", "gloo", timeout_s=timeout_s
        )
        # Plain pickle: tensors travel as bytes, not as torch's shared-memory handles,
        # which need the sending process alive until they are received.
        results.put((rank, True, pickle.dumps(target(rank, world_size, *args))))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        parallel_state.destroy_model_parallel()


# How long a rank found dead may still take to deliver the result it sent before exiting.
DEAD_RANK_GRACE_S = 10.0


def run_ranks(
    target: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 60.0,
    collective_timeout_s: float = 20.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """`target(rank, world_size, *args)` on every rank (module-level, picklable); returns
    the results in rank order."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    common = (port, results, collective_timeout_s, env or {}, args, os.getpid())
    procs = [
        ctx.Process(target=_entry, args=(target, rank, world_size, *common), daemon=True)
        for rank in range(world_size)
    ]
    got: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        for proc in procs:
            proc.start()
        while len(got) < world_size:
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks {sorted(set(range(world_size)) - set(got))} hang")
            try:
                rank, ok, payload = results.get(timeout=0.2)
            except queue.Empty:
                dead = [
                    (r, p.exitcode)
                    for r, p in enumerate(procs)
                    if r not in got and p.exitcode is not None
                ]
                if not dead:
                    continue
                # A rank that reported just before exiting: a process flushes its queue
                # before it exits, so its result is already on the way. Waiting for it (not
                # for a fixed moment) is bounded only for a rank that died without one.
                try:
                    rank, ok, payload = results.get(timeout=DEAD_RANK_GRACE_S)
                except queue.Empty:
                    raise AssertionError(f"rank(s) died without a result: {dead}") from None
            if not ok:
                raise AssertionError(f"rank {rank} raised:\n{payload}")
            got[rank] = pickle.loads(payload)
        for proc in procs:
            proc.join(timeout=max(0.1, deadline - time.monotonic()))
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5)
        results.close()
        results.join_thread()
    return [got[rank] for rank in range(world_size)]


# ---- tiny models ----------------------------------------------------------------------------
def tiny_config(**overrides: Any) -> SimpleNamespace:
    """A Llama config small enough for a few ms per step; a vocabulary that 2 does not divide."""
    settings = dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=509,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        max_position_embeddings=256,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
    )
    settings.update(overrides)
    return SimpleNamespace(**settings)


def checkpoint_tensors(config: SimpleNamespace, seed: int = 0) -> dict[str, torch.Tensor]:
    """The full, unsharded checkpoint of `config` (HF names), seeded: every rank and the
    single-process reference build the same one."""
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 0.08) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * scale

    hidden, inter = config.hidden_size, config.intermediate_size
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    qwen2 = config.architectures[0] == "Qwen2ForCausalLM"
    qkv_bias = qwen2 or config.attention_bias
    o_bias = config.attention_bias and not qwen2
    tensors = {"model.embed_tokens.weight": rand(config.vocab_size, hidden, scale=1.0)}
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        for name, rows in (("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size)):
            tensors[f"{prefix}self_attn.{name}.weight"] = rand(rows, hidden)
            if qkv_bias:
                tensors[f"{prefix}self_attn.{name}.bias"] = rand(rows)
        tensors[f"{prefix}self_attn.o_proj.weight"] = rand(hidden, q_size)
        if o_bias:
            tensors[f"{prefix}self_attn.o_proj.bias"] = rand(hidden)
        tensors[f"{prefix}mlp.gate_proj.weight"] = rand(inter, hidden)
        tensors[f"{prefix}mlp.up_proj.weight"] = rand(inter, hidden)
        tensors[f"{prefix}mlp.down_proj.weight"] = rand(hidden, inter)
        if config.mlp_bias:
            for name, rows in (("gate_proj", inter), ("up_proj", inter), ("down_proj", hidden)):
                tensors[f"{prefix}mlp.{name}.bias"] = rand(rows)
        tensors[f"{prefix}input_layernorm.weight"] = 1 + rand(hidden)
        tensors[f"{prefix}post_attention_layernorm.weight"] = 1 + rand(hidden)
    tensors["model.norm.weight"] = 1 + rand(hidden)
    if not config.tie_word_embeddings:
        tensors["lm_head.weight"] = rand(config.vocab_size, hidden, scale=0.5)
    return tensors


def build_model(config: SimpleNamespace):
    from pagedllm.model.models.llama import LlamaForCausalLM
    from pagedllm.ops.attention_registry import get_attention_backend

    return LlamaForCausalLM(config, get_attention_backend("torch"), torch.float32, 256)


BLOCK_SIZE = 4


def run_steps(model, config: SimpleNamespace, prompt: list[int], decode_tokens: list[int]):
    """Prefill `prompt`, then decode `decode_tokens` one at a time (one request); the
    last-position logits of every step on the sampling rank, None elsewhere.

    Pipeline stages pass (hidden, residual) on through the PP group; each rank's KV cache
    holds its stage's layers and its own KV heads."""
    from pagedllm.distributed.parallel_state import get_pp_group

    pp = get_pp_group()
    attention = model.model.own_layers()[0].self_attn
    num_blocks = 16
    shape = (num_blocks, BLOCK_SIZE, attention.num_kv_heads, attention.head_dim)
    model.bind_kv_cache(
        [(torch.zeros(shape), torch.zeros(shape)) for _ in model.model.own_layers()]
    )
    block_table = np.arange(1, num_blocks, dtype=np.int32)[None, :]
    outputs = []
    done = 0
    for step_tokens in [prompt] + [[t] for t in decode_tokens]:
        n = len(step_tokens)
        positions = np.arange(done, done + n)
        layout = AttentionLayout(
            slot_mapping=(block_table[0, positions // BLOCK_SIZE] * BLOCK_SIZE)
            + positions % BLOCK_SIZE,
            block_tables=block_table,
            query_start_loc=np.array([0, n], dtype=np.int32),
            seq_lens=np.array([done + n], dtype=np.int32),
        )
        metadata = model.attention_backend.build_metadata(layout, torch.device("cpu"))
        intermediate = None
        if not pp.is_first_rank:
            size = (n, config.hidden_size)
            intermediate = (pp.recv(size, torch.float32), pp.recv(size, torch.float32))
        with torch.inference_mode():
            out = model(
                torch.tensor(step_tokens), torch.from_numpy(positions), metadata, intermediate
            )
            if not pp.is_last_rank:
                for tensor in out:
                    pp.send(tensor)
                outputs.append(None)
            else:
                logits = model.compute_logits(out[-1:])
                outputs.append(None if logits is None else logits.clone())
        done += n
    return outputs
