"""Tensor and pipeline parallelism with the features the scheduler and the sampling rank
own, through the `mp` executor on a tiny Llama: three tenants under the fair policy, n > 1
and structured output together, in a pool that preempts. Every sample's greedy tokens equal
one rank's with the same requests (ties counted, as everywhere). Quantized bases too: int8
across ranks held to int8's bar, GGUF blocks over pipeline stages and tensor-parallel ranks
equal to one rank's (over ranks bit for bit, on tiny GGUF files)."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as GGML
from gguf_writer import tiny_model, write_model_gguf
from lora_utils import make_peft_adapter
from model_utils import (
    assert_bit_equal_to_reference,
    compare_to_reference_engine,
    greedy_with_logprobs,
    run_tenants,
    torch_threads,
)
from parallel_greedy import (
    BLOCK_SIZE,
    MAX_TOKENS,
    SPEC_PROMPTS,
    TIE_TOLERANCE,
    budget_llm,
    prompts,
)
from tp_harness import run_ranks

from benchmarks import random_gguf
from benchmarks.parallel_memory import LlamaShape
from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.core import hashing
from pagedllm.distributed.cpu_binding import host_topology, resolve_cpu_binding
from pagedllm.kv_transfer import disk_layout
from pagedllm.kv_transfer.ops import block_key
from pagedllm.sampling_params import StructuredOutputsParams

LAYOUTS = {"tp2": {"tensor_parallel_size": 2}, "pp2": {"pipeline_parallel_size": 2}}
GRAMMAR = StructuredOutputsParams(regex=r"[a-z ]{4,200}")


def requests() -> list[tuple]:
    """Tenants a, b, c in turn; even requests sample twice, odd ones follow the grammar."""
    tenants = ["a", "b", "c"]
    requests = []
    for i, prompt in enumerate(prompts()):
        extra = {"n": 2} if i % 2 == 0 else {"structured_outputs": GRAMMAR}
        params = SamplingParams(
            temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2, **extra
        )
        requests.append((f"r{i}", tenants[i % 3], prompt, params, None))
    return requests


@pytest.fixture(scope="module")
def one_rank(tiny_llama) -> list:
    return run_tenants(budget_llm(tiny_llama, scheduling_policy="fair"), requests(), samples=True)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fair_samples_and_grammar_equal_one_rank(tiny_llama, one_rank, report_ties, layout):
    llm = budget_llm(tiny_llama, scheduling_policy="fair", **LAYOUTS[layout])
    try:
        actual = run_tenants(llm, requests(), samples=True)
        core = llm.llm_engine.engine_core
        assert core.scheduler.num_preemptions > 0
        core.check_integrity()
    finally:
        llm.llm_engine.engine_core.shutdown()
    ties = 0
    for samples, want in zip(actual, one_rank, strict=True):
        assert len(samples) == len(want)
        ties += compare_to_reference_engine(want, samples, TIE_TOLERANCE)[0]
    report_ties(ties, len(actual))


# Each method on one layout: both share the sampling rank's proposing and verifying.
@pytest.mark.parametrize(("method", "layout"), [("ngram", "tp2"), ("suffix", "pp2")])
def test_speculation_across_ranks_equals_one_rank(
    tiny_llama, plain_one_rank, report_ties, layout, method
):
    """Drafts are proposed and verified on the sampling rank; the other ranks run the
    verification step's rows from the scheduler's token ids and drafts."""
    spec = {"method": method, "num_speculative_tokens": 3, "prompt_lookup_min": 2}
    if method == "suffix":
        del spec["prompt_lookup_min"]
    expected = plain_one_rank
    llm = budget_llm(tiny_llama, speculative_config=spec, **LAYOUTS[layout])
    try:
        actual = greedy_with_logprobs(llm, SPEC_PROMPTS, MAX_TOKENS)
        stats = llm.get_stats()
        assert stats.spec_decode.num_drafts > 0 and stats.num_preemptions > 0
        llm.llm_engine.engine_core.check_integrity()
    finally:
        llm.llm_engine.engine_core.shutdown()
    ties, _ = compare_to_reference_engine(expected, actual, TIE_TOLERANCE)
    report_ties(ties, len(actual))


@pytest.mark.parametrize(
    ("drafter", "layout"),
    [(d, layout) for d in ("self", "qwen2") for layout in LAYOUTS] + [("self_quantized", "tp2")],
)
def test_draft_model_across_ranks_equals_one_rank(
    tiny_llama, tiny_model_factory, plain_one_rank, report_ties, layout, drafter
):
    """The draft runs whole on the sampling rank (its own KV of all its layers and heads,
    from that rank's full token history); the target's ranks verify as with ngram. The
    target as its own draft has every draft accepted (the whole draft computes what the
    ranks compute together); another architecture's are rejected, so the draft's KV is cut
    back; all under preemption."""
    draft = tiny_llama if drafter != "qwen2" else tiny_model_factory("Qwen2ForCausalLM")
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    if drafter == "self_quantized":  # the target's own weights, whole and int8
        spec = {"method": "self_quantized", "quantization": "int8", "num_speculative_tokens": 3}
    llm = budget_llm(tiny_llama, draft, speculative_config=spec, **LAYOUTS[layout])
    try:
        actual = greedy_with_logprobs(llm, SPEC_PROMPTS, MAX_TOKENS)
        stats = llm.get_stats()
        assert stats.num_preemptions > 0
        counts = stats.spec_decode
        assert counts.num_drafts > 0
        if drafter == "self":
            assert counts.num_accepted_tokens == counts.num_draft_tokens
        llm.llm_engine.engine_core.check_integrity()
    finally:
        llm.llm_engine.engine_core.shutdown()
    ties, _ = compare_to_reference_engine(plain_one_rank, actual, TIE_TOLERANCE)
    report_ties(ties, len(actual))


@pytest.mark.parametrize(
    ("tiers", "layout"),
    [({"kv_offload_memory": "1MiB"}, "tp2"), ({"preemption_mode": "swap"}, "pp2")],
    ids=["offload-tp2", "swap-pp2"],
)
def test_host_memory_tiers_across_ranks_equal_one_rank(
    tiny_llama, plain_one_rank, report_ties, layout, tiers
):
    """Each rank keeps its own heads' (or layers') blocks in its own host slots, moved by
    the same ops; evicted prefixes come back and swapped requests resume."""
    expected = plain_one_rank
    llm = budget_llm(tiny_llama, **tiers, **LAYOUTS[layout])
    try:
        actual = greedy_with_logprobs(llm, SPEC_PROMPTS, MAX_TOKENS)
        again = greedy_with_logprobs(llm, SPEC_PROMPTS, MAX_TOKENS)  # prefixes from the tier
        core = llm.llm_engine.engine_core
        stats = core.get_stats()
        assert stats.num_preemptions > 0
        moved = stats.kv_tiers["swapped_in_requests"] + stats.kv_tiers["loaded_blocks"]
        assert moved > 0
        core.check_integrity()
    finally:
        llm.llm_engine.engine_core.shutdown()
    ties = 0
    for outputs in (actual, again):
        ties += compare_to_reference_engine(expected, outputs, TIE_TOLERANCE)[0]
    report_ties(ties, 2 * len(expected))


def prompt_block_key(prompt: list[int], index: int) -> str:
    """The KV tiers' key of block `index` of `prompt` (no salt, one KV cache group)."""
    hashes: list[int] = []
    hashing.extend_block_hashes(hashes, prompt, BLOCK_SIZE, None, stable=True)
    return block_key(hashes[index], 0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_disk_tier_across_ranks_equals_one_rank_and_survives_a_restart(
    tiny_llama, plain_one_rank, report_ties, tmp_path, layout
):
    """Each rank writes its own heads' (or layers') bytes of every cached block to files of
    its own; a restarted engine reads the prefixes back from them on every rank. One rank's
    file of a block spoiled makes that block a miss on all ranks: recomputed, still equal."""
    outputs = []
    llm = budget_llm(tiny_llama, kv_offload_dir=str(tmp_path), **LAYOUTS[layout])
    try:
        outputs.append(greedy_with_logprobs(llm, SPEC_PROMPTS, MAX_TOKENS))
        assert llm.get_stats().num_preemptions > 0
        identity = llm.llm_engine.engine_core.config.kv_tier_config.identity
    finally:
        llm.llm_engine.engine_core.shutdown()  # waits for every rank's disk writes
    rank_keys = [
        disk_layout.scan_keys(disk_layout.rank_namespace(tmp_path, identity, rank, 2))
        for rank in range(2)
    ]
    assert rank_keys[0] == rank_keys[1] and len(rank_keys[0]) >= 10
    # Rank 1's file of the fifth block of the longest prompt, which the restart looks up.
    spoiled = disk_layout.block_path(
        disk_layout.rank_namespace(tmp_path, identity, 1, 2), prompt_block_key(prompts()[-1], 4)
    )
    assert spoiled.exists()
    spoiled.write_bytes(spoiled.read_bytes()[:-1] + b"?")

    restarted = budget_llm(tiny_llama, kv_offload_dir=str(tmp_path), **LAYOUTS[layout])
    try:
        outputs.append(greedy_with_logprobs(restarted, SPEC_PROMPTS, MAX_TOKENS))
        core = restarted.llm_engine.engine_core
        tiers = core.get_stats().kv_tiers
        assert tiers["fetched_blocks"] >= 10 and tiers["failed_fetches"] >= 1
        core.check_integrity()
    finally:
        restarted.llm_engine.engine_core.shutdown()
    ties = sum(
        compare_to_reference_engine(plain_one_rank, actual, TIE_TOLERANCE)[0] for actual in outputs
    )
    report_ties(ties, 2 * len(plain_one_rank))


def test_kv_transfer_on_several_ranks_is_refused_by_name(tiny_llama):
    transfer = {"kv_role": "kv_consumer", "kv_port": 0}
    with pytest.raises(ValueError, match="kv_transfer_config with tensor_parallel_size"):
        budget_llm(tiny_llama, kv_transfer_config=transfer, tensor_parallel_size=2)


# int8 rescales each row of its input before quantizing it, and a row-parallel layer's rows
# are each rank's slice: its numbers differ from one rank's by int8's noise, as another
# batch's do. So the ranks are held to int8's own bar (tests/model/test_int8.py): fed one
# rank's greedy answers, they rank its token first at >= 95% of positions (98.6% measured,
# as fp32 does against int8; a lost all-reduce or shard would fall far below).
MIN_INT8_TEACHER_FORCED = 0.95


def teacher_forced_agreement(llm, prompts: list[list[int]], answers: list) -> float:
    """Fraction of the answers' positions where `llm` ranks the answer's token first."""
    score = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    forced = [
        {"prompt_token_ids": prompt + list(answer.token_ids)}
        for prompt, answer in zip(prompts, answers, strict=True)
    ]
    firsts = []
    for output, prompt in zip(llm.generate(forced, score, use_tqdm=False), prompts, strict=True):
        positions = output.prompt_logprobs[len(prompt) :]
        tokens = output.prompt_token_ids[len(prompt) :]
        firsts += [pos[token].rank == 1 for pos, token in zip(positions, tokens, strict=True)]
    return sum(firsts) / len(firsts)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_int8_across_ranks_agrees_with_one_rank(tiny_llama, layout):
    """Column-parallel shards quantize their rows, row-parallel ones sum their int8 partial
    products before the bias, and the head's vocabulary shards are gathered."""
    expected = greedy_with_logprobs(
        budget_llm(tiny_llama, quantization="int8"), SPEC_PROMPTS, MAX_TOKENS
    )
    llm = budget_llm(tiny_llama, quantization="int8", **LAYOUTS[layout])
    try:
        greedy_with_logprobs(llm, SPEC_PROMPTS, MAX_TOKENS)  # under preemption
        assert llm.get_stats().num_preemptions > 0
        agreement = teacher_forced_agreement(llm, SPEC_PROMPTS, expected)
        llm.llm_engine.engine_core.check_integrity()
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert agreement >= MIN_INT8_TEACHER_FORCED


def lora_batch(directory, root) -> tuple[list[dict], list[LoRARequest | None]]:
    """SPEC_PROMPTS under two adapters of `directory` and the base model, in turn."""
    adapters = [
        LoRARequest(f"a{i}", i + 1, str(make_peft_adapter(directory, root / f"a{i}", i + 1)))
        for i in range(2)
    ]
    loras = [adapters[i % 3] if i % 3 < 2 else None for i in range(len(SPEC_PROMPTS))]
    return [{"prompt_token_ids": prompt} for prompt in SPEC_PROMPTS], loras


@pytest.mark.parametrize(
    ("model", "layout"),
    [
        ("LlamaForCausalLM", LAYOUTS["pp2"]),
        ("LlamaForCausalLM", LAYOUTS["tp2"]),
        # q/k/v biases, and one KV head that both ranks hold (each keeps its rows of B).
        ("Qwen2ForCausalLM:kv1-vocab509", LAYOUTS["tp2"]),
        ("LlamaForCausalLM", LAYOUTS["tp2"] | LAYOUTS["pp2"]),  # 4 ranks share 2 cores
    ],
    ids=["llama-pp2", "llama-tp2", "qwen2-kv1-tp2", "llama-tp2xpp2"],
)
def test_lora_across_ranks_equals_one_rank(
    tiny_model_factory, tmp_path, report_ties, model, layout
):
    """Each stage applies the adapters' deltas of its own layers (an adapter's modules on
    the other stage are that stage's to load); each tensor-parallel rank applies its cut of
    them: column-parallel layers their rows of B, row-parallel ones their columns of A, the
    deltas joining the partial sums before the all-reduce."""
    directory = tiny_model_factory(model)
    batch, loras = lora_batch(directory, tmp_path)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)

    def generate(llm, loras=loras) -> list:
        outputs = llm.generate(batch, params, use_tqdm=False, lora_request=loras)
        return [output.outputs[0] for output in outputs]

    one_rank = budget_llm(directory, enable_lora=True, max_loras=2)
    expected = generate(one_rank)
    # The adapters change the tokens: equal ones show their deltas applied on every rank.
    base = generate(one_rank, loras=None)
    changed = [e.token_ids != b.token_ids for e, b in zip(expected, base, strict=True)]
    assert changed == [lora is not None for lora in loras]
    llm = budget_llm(directory, enable_lora=True, max_loras=2, **layout)
    try:
        actual = generate(llm)
        assert llm.get_stats().num_preemptions > 0
        llm.llm_engine.engine_core.check_integrity()
    finally:
        llm.llm_engine.engine_core.shutdown()
    ties, _ = compare_to_reference_engine(expected, actual, TIE_TOLERANCE)
    report_ties(ties, len(actual))


def test_gguf_blocks_across_pipeline_stages_equal_one_rank(tmp_path, report_ties):
    """Each stage keeps its own layers in their GGUF blocks (the first the embedding's, the
    last the tied head's)."""
    model = tiny_model(
        "llama",
        vocab_size=320,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    path = tmp_path / "tiny.gguf"
    write_model_gguf(
        path, model, "llama", lambda name: GGML.Q8_0 if "attn_k" in name else GGML.Q4_0
    )
    common = dict(max_model_len=256, skip_tokenizer_init=True, quantization="gguf")
    prompts = [[token % 320 for token in prompt] for prompt in SPEC_PROMPTS]
    expected = greedy_with_logprobs(LLM(str(path), **common), prompts, MAX_TOKENS)
    llm = LLM(str(path), pipeline_parallel_size=2, **common)
    try:
        actual = greedy_with_logprobs(llm, prompts, MAX_TOKENS)
    finally:
        llm.llm_engine.engine_core.shutdown()
    ties, _ = compare_to_reference_engine(expected, actual, TIE_TOLERANCE)
    report_ties(ties, len(actual))


# ---- GGUF blocks over tensor-parallel ranks ---------------------------------------------------
# Each rank keeps whole rows of the blocks (model/layers/gguf_parallel.py); o and down compute
# their output rows over the whole K after an all-gather, so the ranks' logits are one rank's
# bit for bit. Both files' per-rank K slices are NOT whole blocks: the K-quant file's o_proj
# slice is 2 heads x 64 = 128 and down_proj's 768 / 2 = 384 (blocks of 256); the Q4_0/Q8_0
# file's 2 heads x 24 = 48 and 160 / 2 = 80 (blocks of 32). Vocabularies 49,216 and 320 pad
# to 49,280 and 384: the second rank's head and embedding shards end in zero rows.
# The exact comparison holds for the GGUF layers everywhere; the fp32 `cpu` attention kernel
# groups its rows by the q heads sharing a KV head, so where that number changes with tp its
# bits do too (1e-5 measured with one KV head of 4 q heads). The K-quant file keeps 2 q heads
# a KV head on both layouts; the other file's head_dim 24 runs on the torch attention path,
# whose scaled_dot_product_attention sums in another order at another thread count on some
# CPUs (an AVX2 EPYC: 44 of 79 context lengths differ between 1 and 2 threads), so one rank
# runs with the thread count each rank gets.
K_QUANT_SHAPE = LlamaShape("tiny", 256, 768, 4, 4, 2, 49152 + 64)


def _q4_0_q8_0_type(name: str) -> GGML:
    """A Q8_0 tied embedding and k (q/k/v of mixed types: three kernel layers), Q4_0 else."""
    return GGML.Q8_0 if name.startswith("token_embd") or "attn_k" in name else GGML.Q4_0


@pytest.fixture(scope="module")
def gguf_tp_files(tmp_path_factory) -> dict[str, tuple[str, int]]:
    """name -> (path, vocabulary): a Q4_K_M file (Q4_K and Q6_K, mixed q/k/v in layers 2 and
    3, an untied Q6_K head) and a Q4_0/Q8_0 file (tied embedding, one KV head replicated)."""
    directory = tmp_path_factory.mktemp("gguf-tp")
    k_quant = directory / "tiny-q4_k_m.gguf"
    random_gguf.write_random_gguf(k_quant, K_QUANT_SHAPE, random_gguf.FILE_TYPES["Q4_K_M"])
    model = tiny_model(
        "llama",
        vocab_size=320,
        hidden_size=96,
        intermediate_size=160,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    legacy = directory / "tiny-q4_0-q8_0.gguf"
    write_model_gguf(legacy, model, "llama", _q4_0_q8_0_type)
    return {
        "q4_k_m": (str(k_quant), K_QUANT_SHAPE.vocab_size),
        "q4_0-q8_0": (str(legacy), 320),
    }


@pytest.mark.parametrize("name", ["q4_k_m", "q4_0-q8_0"])
def test_gguf_blocks_over_tensor_parallel_ranks_equal_one_rank(gguf_tp_files, name, report_ties):
    """Greedy tokens and every top-2 logprob equal one rank's exactly (no tie is needed)."""
    path, vocab = gguf_tp_files[name]
    common = dict(max_model_len=256, skip_tokenizer_init=True, quantization="gguf")
    prompts = [[token % vocab for token in prompt] for prompt in SPEC_PROMPTS]
    rank_threads = {b.num_threads for b in resolve_cpu_binding("auto", 2, host_topology())}
    assert len(rank_threads) == 1, rank_threads
    with torch_threads(rank_threads.pop()):
        expected = greedy_with_logprobs(LLM(path, **common), prompts, MAX_TOKENS)
    llm = LLM(path, tensor_parallel_size=2, **common)
    try:
        actual = greedy_with_logprobs(llm, prompts, MAX_TOKENS)
        llm.llm_engine.engine_core.check_integrity()
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert_bit_equal_to_reference(expected, actual, report_ties)


def _gguf_rank_logits(rank, world_size, paths: list[str]) -> list:
    """Per file: (every step's last-position logits on this rank, None off rank 0; the
    bytes of the GGUF tables this rank holds)."""
    from tp_harness import run_steps

    from pagedllm.distributed.parallel_state import initialize_model_parallel
    from pagedllm.model.gguf_loader import load_gguf_config
    from pagedllm.model.layers.gguf_linear import distinct_bytes
    from pagedllm.model.layers.gguf_parallel import GGUFRowParallelLinear
    from pagedllm.model.layers.gguf_swap import keep_gguf_blocks
    from pagedllm.model.loader import ModelSource, load_weights
    from pagedllm.model.models.llama import LlamaForCausalLM
    from pagedllm.ops.attention_registry import get_attention_backend
    from pagedllm.parallel_config import padded_vocab_size

    initialize_model_parallel(world_size, 1)
    results = []
    for path in paths:
        config = load_gguf_config(path)
        backend = get_attention_backend("torch")
        model = LlamaForCausalLM(config, backend, torch.float32, 256)
        consumed = keep_gguf_blocks(model, path)
        load_weights(model, ModelSource(path, is_gguf=True), config, skip=frozenset(consumed))
        row_parallel = [m for m in model.modules() if isinstance(m, GGUFRowParallelLinear)]
        assert len(row_parallel) == (2 * config.num_hidden_layers if world_size > 1 else 0)
        # Ids on both sides of the vocabulary shards' boundary, and the last real one.
        edge, last = padded_vocab_size(config.vocab_size, 2) // 2, config.vocab_size - 1
        prompt = [5, 17, edge - 1, edge, edge + 1, last, 100, 3]
        logits = run_steps(model, config, prompt, [0, last, edge])
        held = distinct_bytes(b for n, b in model.named_buffers() if "rotary" not in n)
        results.append((logits, held))
    return results


def test_gguf_tensor_parallel_logits_are_one_ranks_bit_for_bit(gguf_tp_files):
    """The full logits of a prefill and three decode steps (torch attention), torch.equal
    to one rank's; each rank holds about half of one rank's GGUF tables."""
    paths = [path for path, _ in gguf_tp_files.values()]
    (one_rank,) = run_ranks(_gguf_rank_logits, 1, paths, timeout_s=120)
    tp_ranks = run_ranks(_gguf_rank_logits, 2, paths, timeout_s=120)
    for (want, whole), (got, first), (others, second) in zip(one_rank, *tp_ranks, strict=True):
        assert len(got) == len(want) == 4 and all(step is None for step in others)
        for a, b in zip(want, got, strict=True):
            assert a.shape == b.shape
            assert torch.equal(a, b)
        print(f"GGUF tables: one rank {whole} bytes, TP ranks {first} and {second}")
        # Half, plus the padding a shard rounds up to: measured 50.1% on the K-quant file,
        # 56% on the tiny one (its 320-token vocabulary pads to 384).
        assert first <= 0.6 * whole and second <= 0.6 * whole
