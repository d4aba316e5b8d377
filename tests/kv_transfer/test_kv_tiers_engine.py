"""The KV tiers end to end on a tiny model: host offload, the disk tier across a restart and
around a corrupted file, and swap preemption, each against the same engine without tiers."""

from __future__ import annotations

import functools
import random

import pytest
from model_utils import model_runner

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineArgs
from pagedllm.core import hashing
from pagedllm.core.engine_config import kv_bytes_per_block, load_engine_config
from pagedllm.kv_transfer import disk_layout

BLOCK = 16


@functools.cache
def bytes_per_block(model, kv_cache_dtype: str = "auto") -> int:
    args = EngineArgs(
        str(model), max_model_len=256, block_size=BLOCK, kv_cache_dtype=kv_cache_dtype
    )
    config = load_engine_config(args)[2]
    return kv_bytes_per_block(
        config.model_config, BLOCK, config.cache_config.cache_dtype, None,
        config.cache_config.kv_groups,
    )  # fmt: skip


def tiny_engine(model, num_blocks=25, **args) -> LLM:
    """An engine whose pool holds `num_blocks` blocks (block 0 is the null block)."""
    return LLM(
        str(model),
        max_model_len=256,
        block_size=BLOCK,
        kv_cache_memory=bytes_per_block(model, args.get("kv_cache_dtype", "auto")) * num_blocks,
        **args,
    )


def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 200) for _ in range(length)] for _ in range(count)]


def generate(llm: LLM, batch: list[list[int]], max_tokens: int = 8) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def computed_prompt_tokens(llm: LLM) -> int:
    return llm.llm_engine.engine_core.get_stats().num_computed_prompt_tokens


def tier_stats(llm: LLM) -> dict[str, float]:
    stats = llm.llm_engine.engine_core.get_stats().kv_tiers
    assert stats is not None
    return stats


@pytest.fixture(scope="module")
def reference(tiny_model_factory):
    """Greedy outputs of a roomy engine without tiers."""
    model = tiny_model_factory("LlamaForCausalLM")
    llm = LLM(str(model), max_model_len=256, block_size=BLOCK, kv_cache_memory="8MiB")
    system = prompts(1, 160, seed=1)[0]
    others = prompts(3, 150, seed=2)
    batch = [[*system, 7, 8, 9], *others, [*system, 11, 12]]
    outputs = {tuple(p): out for p, out in zip(batch, generate(llm, batch), strict=True)}
    llm.llm_engine.engine_core.shutdown()
    return model, system, others, outputs


def test_evicted_prefix_is_loaded_from_host_not_recomputed(reference):
    model, system, others, want = reference
    llm = tiny_engine(model, kv_offload_memory="4MiB")
    first = [*system, 7, 8, 9]
    assert generate(llm, [first]) == [want[tuple(first)]]
    for other in others:  # each evicts the pool's cached blocks of the one before
        assert generate(llm, [other]) == [want[tuple(other)]]
    assert tier_stats(llm)["saved_blocks"] >= 10
    again = [*system, 11, 12]
    before = computed_prompt_tokens(llm)
    assert generate(llm, [again]) == [want[tuple(again)]]
    # The 10 full blocks of the system prompt came from the host tier: only the rest ran.
    assert computed_prompt_tokens(llm) - before == len(again) - 160
    assert tier_stats(llm)["host_hit_tokens"] >= 160
    llm.llm_engine.engine_core.shutdown()


def test_without_a_tier_the_evicted_prefix_is_recomputed(reference):
    model, system, others, want = reference
    llm = tiny_engine(model)
    generate(llm, [[*system, 7, 8, 9]])
    for other in others:
        generate(llm, [other])
    again = [*system, 11, 12]
    before = computed_prompt_tokens(llm)
    assert generate(llm, [again]) == [want[tuple(again)]]
    assert computed_prompt_tokens(llm) - before == len(again)
    llm.llm_engine.engine_core.shutdown()


def test_disk_tier_survives_a_restart(reference, tmp_path):
    model, system, _, want = reference
    first, again = [*system, 7, 8, 9], [*system, 11, 12]
    llm = tiny_engine(model, kv_offload_dir=str(tmp_path))
    assert generate(llm, [first]) == [want[tuple(first)]]
    llm.llm_engine.engine_core.shutdown()  # waits for the disk writes
    files = list(tmp_path.glob(f"*/*/*{disk_layout.SUFFIX}"))
    assert len(files) >= 10
    del llm

    restarted = tiny_engine(model, kv_offload_dir=str(tmp_path))
    before = computed_prompt_tokens(restarted)
    assert generate(restarted, [again]) == [want[tuple(again)]]
    assert computed_prompt_tokens(restarted) - before == len(again) - 160
    assert tier_stats(restarted)["fetched_blocks"] >= 10
    restarted.llm_engine.engine_core.shutdown()


def _block_file(identity_dir, tokens: list[int], index: int):
    """(path, key, token ids) of the disk-tier file of block `index` of `tokens`."""
    hashes: list[int] = []
    hashing.extend_block_hashes(hashes, tokens, BLOCK, None, stable=True)
    key = f"{hashes[index]:032x}.0"
    block_tokens = tuple(tokens[index * BLOCK : (index + 1) * BLOCK])
    return disk_layout.block_path(identity_dir, key), key, block_tokens


def _recomputes_from_fourth_block(model, tier, prompt: list[int], want) -> int:
    """A new engine on `tier` answers `prompt` as the reference does, loading its first three
    blocks and recomputing from the fourth on (a failed fetch); returns a block's bytes."""
    restarted = tiny_engine(model, kv_offload_dir=str(tier))
    before = computed_prompt_tokens(restarted)
    assert generate(restarted, [prompt]) == [want[tuple(prompt)]]
    assert computed_prompt_tokens(restarted) - before == len(prompt) - 3 * BLOCK
    assert tier_stats(restarted)["failed_fetches"] >= 1
    block_bytes = model_runner(restarted).kv_tiers.nbytes_per_block
    restarted.llm_engine.engine_core.shutdown()
    return block_bytes


def test_corrupted_disk_block_is_detected_and_recomputed(reference, tmp_path):
    model, system, _, want = reference
    first, again = [*system, 7, 8, 9], [*system, 11, 12]
    llm = tiny_engine(model, kv_offload_dir=str(tmp_path))
    generate(llm, [first])
    llm.llm_engine.engine_core.shutdown()
    del llm
    # Flip one payload byte of the fourth block's file, truncate the sixth's.
    identity_dir = next(tmp_path.iterdir())
    fourth, key, tokens = _block_file(identity_dir, first, 3)
    data = bytearray(fourth.read_bytes())
    data[-1] ^= 0xFF
    fourth.write_bytes(bytes(data))
    sixth, _, _ = _block_file(identity_dir, first, 5)
    sixth.write_bytes(sixth.read_bytes()[:100])

    block_bytes = _recomputes_from_fourth_block(model, tmp_path, again, want)
    # The corrupted block was written again, whole, when recomputed.
    payload = disk_layout.decode_block_file(
        fourth.read_bytes(), identity_dir.name, key, tokens, block_bytes
    )
    assert len(payload) == block_bytes


@pytest.mark.parametrize("target", ["a genuine copy", "/dev/zero"])
def test_linked_disk_block_is_refused_and_recomputed(reference, tmp_path, target):
    """A block file replaced by a link between two engines sharing the folder (to /dev/zero:
    read whole, it would exhaust memory) is refused unread and recomputed: same output."""
    model, system, _, want = reference
    first, again = [*system, 7, 8, 9], [*system, 11, 12]
    tier = tmp_path / "tier"
    llm = tiny_engine(model, kv_offload_dir=str(tier))
    assert generate(llm, [first]) == [want[tuple(first)]]
    llm.llm_engine.engine_core.shutdown()
    del llm
    identity_dir = next(tier.iterdir())
    fourth, key, tokens = _block_file(identity_dir, first, 3)
    copy = tmp_path / "copy.kvb"
    copy.write_bytes(fourth.read_bytes())
    fourth.unlink()
    fourth.symlink_to(copy if target == "a genuine copy" else target)

    block_bytes = _recomputes_from_fourth_block(model, tier, again, want)
    # The link was deleted (not its target) and the recomputed block written in its place.
    assert not fourth.is_symlink()
    size = disk_layout.block_file_size(identity_dir.name, key, tokens, block_bytes)
    assert fourth.stat().st_size == copy.stat().st_size == size
    payload = disk_layout.decode_block_file(
        fourth.read_bytes(), identity_dir.name, key, tokens, block_bytes
    )
    assert len(payload) == block_bytes


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_swap_preemption_equals_recompute_and_no_preemption(tiny_model_factory, mode):
    model = tiny_model_factory("LlamaForCausalLM")
    batch = prompts(6, 40, seed=5)
    roomy = LLM(str(model), max_model_len=256, block_size=BLOCK, kv_cache_memory="8MiB")
    want = generate(roomy, batch, max_tokens=48)
    roomy.llm_engine.engine_core.shutdown()
    # 6 requests of up to 88 tokens (6 blocks each) in 20 blocks: preemption is certain.
    llm = tiny_engine(model, num_blocks=21, preemption_mode=mode, enable_prefix_caching=False)
    assert generate(llm, batch, max_tokens=48) == want
    stats = llm.llm_engine.engine_core.get_stats()
    assert stats.num_preemptions > 0
    if mode == "swap":
        assert stats.kv_tiers["swapped_out_requests"] == stats.num_preemptions
        assert stats.kv_tiers["swapped_in_requests"] == stats.num_preemptions
    core = llm.llm_engine.engine_core
    core.check_integrity()  # every block back in the pool, every host slot free
    assert (
        core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.block_pool.num_usable_blocks
    )
    if core.kv_tiers is not None:
        assert core.kv_tiers.num_free_host_blocks == core.kv_tiers.config.num_host_blocks
    core.shutdown()


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("prompt_length", [163, 160, 161])
def test_prefill_instance_ships_the_prompt_to_the_decode_instance(reference, prompt_length):
    model, system, others, _ = reference
    prompt = (system + others[0])[:prompt_length]
    roomy = LLM(str(model), max_model_len=256, block_size=BLOCK, kv_cache_memory="8MiB")
    (want,) = generate(roomy, [prompt])
    roomy.llm_engine.engine_core.shutdown()
    port = free_port()
    consumer = tiny_engine(model, kv_transfer_config={"kv_role": "kv_consumer", "kv_port": port})
    producer = tiny_engine(
        model,
        kv_transfer_config={
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"peer": f"127.0.0.1:{port}"},
        },
    )
    try:
        assert generate(producer, [prompt], max_tokens=1) == [want[:1]]
        assert tier_stats(producer)["sent_requests"] == 1
        before = computed_prompt_tokens(consumer)
        assert generate(consumer, [prompt]) == [want]
        # Every prompt block came from the producer, the partly filled last one too: the
        # consumer computed only the last prompt token.
        assert computed_prompt_tokens(consumer) - before == 1
        assert tier_stats(consumer)["received_blocks"] == -(-prompt_length // BLOCK)
    finally:
        producer.llm_engine.engine_core.shutdown()
        consumer.llm_engine.engine_core.shutdown()


def test_producer_without_a_consumer_still_answers(reference):
    model, system, _, want = reference
    prompt = [*system, 7, 8, 9]
    producer = tiny_engine(
        model,
        kv_transfer_config={
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"peer": f"127.0.0.1:{free_port()}", "timeout_s": 0.5},
        },
    )
    assert generate(producer, [prompt], max_tokens=8) == [want[tuple(prompt)]]
    stats = tier_stats(producer)
    assert stats["failed_sends"] == 1 and stats["sent_requests"] == 0
    producer.llm_engine.engine_core.shutdown()


@pytest.mark.parametrize(
    ("variant", "num_blocks", "num_swap_blocks"),
    # Pools just small enough that the other prompts evict the first one's blocks, and that
    # the swap batch preempts (a windowed layer holds at most 3 blocks of a request).
    [("Qwen2ForCausalLM:hybrid24", 41, 21), ("MistralForCausalLM:window24", 21, 8)],
)
@pytest.mark.slow  # long (20-30 s each on two busy cores)
def test_tiers_with_sliding_windows(
    tiny_model_factory, variant, num_blocks, num_swap_blocks, tmp_path
):
    """Windowed layers (their own KV cache group, or every layer windowed): host hits, the
    disk tier after a restart and swap give the roomy engine's output."""
    model = tiny_model_factory(variant)
    system = prompts(1, 160, seed=1)[0]
    others = prompts(2, 150, seed=2)
    first, again = [*system, 7, 8, 9], [*system, 11, 12]
    roomy = LLM(str(model), max_model_len=256, block_size=BLOCK, kv_cache_memory="8MiB")
    want = generate(roomy, [first, *others, again])
    roomy.llm_engine.engine_core.shutdown()

    llm = tiny_engine(
        model, num_blocks=num_blocks, kv_offload_memory="4MiB", kv_offload_dir=str(tmp_path)
    )
    assert generate(llm, [first, *others]) == want[:3]
    assert generate(llm, [again]) == want[3:]
    assert tier_stats(llm)["host_hit_tokens"] > 0
    llm.llm_engine.engine_core.shutdown()
    restarted = tiny_engine(model, num_blocks=num_blocks, kv_offload_dir=str(tmp_path))
    before = computed_prompt_tokens(restarted)
    assert generate(restarted, [again]) == want[3:]
    assert computed_prompt_tokens(restarted) - before < len(again)
    restarted.llm_engine.engine_core.shutdown()

    swapping = tiny_engine(model, num_blocks=num_swap_blocks, preemption_mode="swap")
    batch = prompts(6, 40, seed=5)
    roomy = LLM(str(model), max_model_len=256, block_size=BLOCK, kv_cache_memory="8MiB")
    expected = generate(roomy, batch, max_tokens=48)
    roomy.llm_engine.engine_core.shutdown()
    assert generate(swapping, batch, max_tokens=48) == expected
    stats = swapping.llm_engine.engine_core.get_stats()
    assert stats.num_preemptions > 0
    assert stats.kv_tiers["swapped_in_requests"] == stats.num_preemptions
    swapping.llm_engine.engine_core.shutdown()


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e5m2"])
def test_tiers_move_quantized_blocks_with_their_scales(reference, kv_cache_dtype):
    """An 8-bit cache's blocks (values and scales) come back from the host tier and from
    swap bit for bit: the same output as the same engine without tiers."""
    model, system, others, _ = reference
    first, again = [*system, 7, 8, 9], [*system, 11, 12]
    roomy = LLM(
        str(model), max_model_len=256, block_size=BLOCK, kv_cache_memory="8MiB",
        kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip
    want = generate(roomy, [first, *others, again])
    roomy.llm_engine.engine_core.shutdown()
    llm = tiny_engine(model, num_blocks=25, kv_cache_dtype=kv_cache_dtype, kv_offload_memory="4MiB")
    assert [generate(llm, [p])[0] for p in [first, *others]] == want[:4]
    before = computed_prompt_tokens(llm)
    assert generate(llm, [again]) == want[4:]
    assert computed_prompt_tokens(llm) - before == len(again) - 160
    llm.llm_engine.engine_core.shutdown()
