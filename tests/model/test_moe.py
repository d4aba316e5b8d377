"""Mixture of experts (Mixtral, Qwen3-MoE) against Transformers on tiny random models: the
router's experts and weights per token (bit for bit on the same hidden states, in fp32 and
bf16), the block's output on batches where some experts get no token, both checkpoint
forms (per expert, stacked), the whole model's logits, greedy tokens on a shared prefix
served from the prefix cache, tensor and pipeline parallelism, the block traced whole for
the compiled decode step, int8 leaving the experts alone, and refused configurations.
(Chunked prefill, preemption and block size 7: tests/engine/test_greedy_vs_transformers.py.)"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "distributed"))
from model_utils import compare_greedy, hf_greedy
from tp_harness import run_ranks, run_steps

from pagedllm.model.layers.fused_moe import FusedMoE, MoESpec
from pagedllm.model.layers.quantization import quantize_model
from pagedllm.model.loader import ModelSource, iter_weights, load_weights
from pagedllm.model.models.mixtral import mixtral_spec, qwen3_moe_spec
from pagedllm.model.registry import resolve_model_class
from pagedllm.ops.attention_registry import get_attention_backend

# (HF model_type, the block's settings); 4 experts, top-2, as the engine tests' tiny models.
BLOCKS = {
    "mixtral": ("mixtral", dict(num_local_experts=4, intermediate_size=48)),
    "qwen3-norm": ("qwen3_moe", dict(num_experts=4, moe_intermediate_size=48, norm_topk_prob=True)),
    "qwen3-raw": ("qwen3_moe", dict(num_experts=4, moe_intermediate_size=48, norm_topk_prob=False)),
}
TIE_TOLERANCE = 1e-4
PROMPT = [5, 17, 500, 3, 250, 255, 256, 257, 100, 42, 7]
DECODE = [507, 1, 256]


def _block_config(name: str, implementation: str = "grouped_mm"):
    from transformers import AutoConfig

    model_type, settings = BLOCKS[name]
    config = AutoConfig.for_model(
        model_type, hidden_size=64, num_experts_per_tok=2, hidden_act="silu", **settings
    )
    config._experts_implementation = implementation
    return config


def _blocks(name: str, dtype: torch.dtype, implementation: str = "grouped_mm"):
    """(Transformers' sparse MoE block, ours) on the same random weights."""
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = _block_config(name, implementation)
    torch.manual_seed(0)
    if config.model_type == "mixtral":
        hf_block, spec = MixtralSparseMoeBlock(config), mixtral_spec(config)
    else:
        hf_block, spec = Qwen3MoeSparseMoeBlock(config), qwen3_moe_spec(config)
    with torch.no_grad():
        for param in hf_block.parameters():
            param.normal_(0.0, 0.2)
    hf_block = hf_block.to(dtype).eval()
    ours = FusedMoE(spec, dtype)
    ours.gate.weight.data.copy_(hf_block.gate.weight)
    ours.experts.weight_loader(ours.experts.gate_up_proj, hf_block.experts.gate_up_proj.data)
    ours.experts.weight_loader(ours.experts.down_proj, hf_block.experts.down_proj.data)
    assert ours.experts.missing_shards() == []
    return hf_block, ours


def _hidden(num_tokens: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return torch.randn(num_tokens, 64, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(BLOCKS))
def test_router_equals_transformers_per_token(name, dtype):
    hf_block, ours = _blocks(name, dtype)
    x = _hidden(200, dtype)
    with torch.no_grad():
        _, hf_weights, hf_ids = hf_block.gate(x)
        weights, ids = ours.gate(x)
    assert torch.equal(ids, hf_ids)
    # Mixtral keeps fp32 weights, Qwen3-MoE casts them to the hidden dtype.
    assert weights.dtype == hf_weights.dtype
    assert torch.equal(weights, hf_weights)
    sums = weights.float().sum(dim=-1)
    if name == "qwen3-raw":
        assert (sums < 0.99).any(), "without norm_topk_prob the top-2 weights sum below 1"
    else:
        torch.testing.assert_close(sums, torch.ones_like(sums), atol=1e-2, rtol=0)


@pytest.mark.parametrize("implementation", ["grouped_mm", "eager"])
@pytest.mark.parametrize("name", list(BLOCKS))
def test_block_equals_transformers_when_experts_get_no_tokens(name, implementation):
    hf_block, ours = _blocks(name, torch.float32, implementation)
    one_token = _hidden(1, torch.float32)
    # A batch no token routes to expert 0: its router row points against every token.
    positive = _hidden(9, torch.float32, seed=2).abs()
    ours.gate.weight.data[0] = hf_block.gate.weight.data[0] = -1.0
    for x in (one_token, positive, _hidden(33, torch.float32, seed=3)):
        with torch.no_grad():
            want = hf_block(x[None])[0]
            got = ours(x)
            _, ids = ours.gate(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.bincount(ids.flatten(), minlength=4).min() > 0, "the large batch uses all"
    with torch.no_grad():
        used = torch.bincount(ours.gate(positive)[1].flatten(), minlength=4)
    assert used[0] == 0 and used.sum() == 18


@pytest.mark.parametrize("name", ["mixtral", "qwen3-norm"])
def test_block_in_bf16_stays_close_to_transformers(name):
    hf_block, ours = _blocks(name, torch.bfloat16)
    x = _hidden(17, torch.bfloat16)
    with torch.no_grad():
        want, got = hf_block(x[None])[0].float(), ours(x).float()
    assert ours(x).dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


# ---- whole models ---------------------------------------------------------------------------
def _build(config, dtype: torch.dtype = torch.float32):
    model_class = resolve_model_class(config.architectures)
    return model_class(config, get_attention_backend("torch"), dtype, 256)


def _hf_model(directory: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def _router_choices(gates: list[torch.nn.Module], pick) -> tuple[list, list]:
    """Forward hooks recording each router call's output through `pick`."""
    seen: list = []
    handles = [g.register_forward_hook(lambda _m, _i, out: seen.append(pick(out))) for g in gates]
    return seen, handles


@pytest.mark.parametrize("architecture", ["MixtralForCausalLM", "Qwen3MoeForCausalLM"])
def test_model_loads_both_checkpoint_forms_and_matches_transformers(
    architecture, tiny_model_factory
):
    directory = tiny_model_factory(architecture)
    hf_model = _hf_model(directory)
    config = hf_model.config
    stacked = hf_model.state_dict()  # Transformers' own names: experts stacked
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in stacked)
    per_expert = _build(config)
    load_weights(per_expert, ModelSource(str(directory), is_gguf=False), config)
    from_stacked = _build(config)
    from_stacked.load_weights(stacked.items())
    for (name, a), (_, b) in zip(
        per_expert.named_parameters(), from_stacked.named_parameters(), strict=True
    ):
        assert torch.equal(a, b), name

    moe_layers = [i for i, layer in enumerate(per_expert.model.layers) if _is_moe(layer)]
    expected_moe = [0, 1] if architecture == "MixtralForCausalLM" else [0, 2]
    assert moe_layers == expected_moe
    ours, ours_hooks = _router_choices(
        [per_expert.model.layers[i].mlp.gate for i in moe_layers], lambda out: out[1]
    )
    theirs, hf_hooks = _router_choices(
        [hf_model.model.layers[i].mlp.gate for i in moe_layers], lambda out: out[2]
    )
    logits = run_steps(per_expert, config, PROMPT, DECODE)
    with torch.no_grad():
        hf_logits = hf_model(torch.tensor([PROMPT + DECODE])).logits[0]
    for handle in ours_hooks + hf_hooks:
        handle.remove()
    # Every token's experts in every MoE layer (the prompt's and the decoded ones).
    hf_ids = torch.cat([torch.cat(theirs[j :: len(moe_layers)]) for j in range(len(moe_layers))])
    our_ids = torch.cat([torch.cat(ours[j :: len(moe_layers)]) for j in range(len(moe_layers))])
    assert our_ids.shape == (len(moe_layers) * len(PROMPT + DECODE), 2)
    assert torch.equal(our_ids, hf_ids)
    for step, got in enumerate(logits):
        want = hf_logits[len(PROMPT) - 1 + step]
        torch.testing.assert_close(got[0], want, rtol=1e-4, atol=1e-4)


def _is_moe(layer) -> bool:
    return isinstance(getattr(layer, "mlp", None), FusedMoE)


def test_int8_quantizes_around_the_experts(tiny_model_factory):
    directory = tiny_model_factory("MixtralForCausalLM")
    model = _build(_hf_model(directory).config)
    load_weights(model, ModelSource(str(directory), is_gguf=False), model.config)
    experts = model.model.layers[0].mlp.experts.gate_up_proj.clone()
    reference = run_steps(model, model.config, PROMPT, [])[0]
    replaced = quantize_model(model, "int8")
    assert "model.layers.0.self_attn.qkv_proj" in replaced
    assert not [name for name in replaced if ".mlp." in name], "experts and router stay fp32"
    assert torch.equal(model.model.layers[0].mlp.experts.gate_up_proj, experts)
    quantized = run_steps(model, model.config, PROMPT, [])[0]
    assert quantized.argmax() == reference.argmax()


@pytest.mark.parametrize(
    "architecture",
    [pytest.param("MixtralForCausalLM", marks=pytest.mark.slow), "Qwen3MoeForCausalLM"],  # ~8 s
)
def test_shared_prefix_hits_the_cache_and_matches_transformers(
    architecture, tiny_model_factory, report_ties
):
    # The engine test's KV budget evicts a prompt's blocks before it runs again alone; here
    # the later prompts start on the first one's cached blocks (block size 7: 6 full blocks).
    from pagedllm import LLM, SamplingParams

    directory = tiny_model_factory(architecture)
    hf_model = _hf_model(directory)
    prefix = [(37 * i + 11) % 509 + 3 for i in range(45)]
    prompts = [[*prefix, 7 + j, 300 + j, 42] for j in range(3)]
    references = [hf_greedy(hf_model, p, 12) for p in prompts]
    llm = LLM(str(directory), max_model_len=128, block_size=7, kv_cache_memory="2MiB")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = [llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0] for p in prompts]
    stats = llm.llm_engine.engine_core.kv_cache_manager.prefix_cache_stats
    assert stats.hits == 2 * 42, stats
    ties = sum(
        compare_greedy(out.outputs[0].token_ids, ref, TIE_TOLERANCE)
        for out, ref in zip(outputs, references, strict=True)
    )
    report_ties(ties, len(prompts))


# ---- tensor and pipeline parallel -----------------------------------------------------------
def _ranks_forward(rank, world_size, tp, pp, directory, settings):
    from pagedllm.distributed.parallel_state import initialize_model_parallel

    initialize_model_parallel(tp, pp)
    config = SimpleNamespace(**settings)  # the model reads attributes only; no transformers
    model = _build(config)
    load_weights(model, ModelSource(directory, is_gguf=False), config, lazy=True)
    experts = [layer.mlp.experts for layer in model.model.own_layers() if _is_moe(layer)]
    shard_rows = [e.gate_up_proj.shape[1] for e in experts]
    return run_steps(model, config, PROMPT, DECODE), shard_rows


def _single_process_reference(directory: Path):
    config = _hf_model(directory).config
    model = _build(config)
    load_weights(model, ModelSource(str(directory), is_gguf=False), config)
    return config, run_steps(model, config, PROMPT, DECODE)


@pytest.mark.slow  # two worker processes
def test_tp2_matches_single_process(tiny_model_factory):
    # Each of the two ranks holds half of every expert of Qwen3-MoE's sparse layers 0 and 2
    # (and half of the dense layer 1), reading only its slice of the checkpoint.
    directory = tiny_model_factory("Qwen3MoeForCausalLM")
    config, reference = _single_process_reference(directory)
    settings = config.to_dict()
    results = run_ranks(_ranks_forward, 2, 2, 1, str(directory), settings, timeout_s=180)
    half = config.moe_intermediate_size  # gate and up rows, each half of the intermediate size
    for rank, (logits, shard_rows) in enumerate(results):
        assert shard_rows == [half, half], f"rank {rank}: {shard_rows}"
        if rank != 0:  # the first TP rank computes the logits
            assert all(step is None for step in logits)
            continue
        for got, want in zip(logits, reference, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-4)


class _TwoStages:
    """Two pipeline stages of one model in this process, run back to back as one model
    (what `run_steps` drives), the first stage's IntermediateTensors handed on directly."""

    def __init__(self, first, second) -> None:
        self.first, self.second = first, second
        self.attention_backend = first.attention_backend
        layers = first.model.own_layers() + second.model.own_layers()
        self.model = SimpleNamespace(own_layers=lambda: layers)

    def bind_kv_cache(self, kv_caches) -> None:
        split = len(self.first.model.own_layers())
        self.first.bind_kv_cache(kv_caches[:split])
        self.second.bind_kv_cache(kv_caches[split:])

    def __call__(self, input_ids, positions, metadata, _intermediate=None):
        between = self.first(input_ids, positions, metadata)
        return self.second(input_ids, positions, metadata, between)

    def compute_logits(self, hidden):
        return self.second.compute_logits(hidden)


def test_pipeline_stages_load_their_layers_and_chain(tiny_model_factory, monkeypatch):
    import pagedllm.model.models.llama as llama
    from pagedllm.distributed.parallel_state import GroupCoordinator

    directory = tiny_model_factory("Qwen3MoeForCausalLM")
    config, reference = _single_process_reference(directory)
    stages = []
    for rank in (0, 1):  # stage 0: layers 0 (sparse) and 1 (dense); stage 1: layer 2
        group = GroupCoordinator([0, 1], rank, torch.device("cpu"))
        monkeypatch.setattr(llama, "get_pp_group", lambda group=group: group)
        stage = _build(config)
        load_weights(stage, ModelSource(str(directory), is_gguf=False), config)
        stages.append(stage)
    monkeypatch.undo()
    held = [[name for name, _ in stage.named_parameters() if "experts" in name] for stage in stages]
    assert held == [
        ["model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"],
        ["model.layers.2.mlp.experts.gate_up_proj", "model.layers.2.mlp.experts.down_proj"],
    ]
    logits = run_steps(_TwoStages(*stages), config, PROMPT, DECODE)
    for got, want in zip(logits, reference, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ---- refusals -------------------------------------------------------------------------------
def test_missing_expert_is_named(tiny_model_factory):
    directory = tiny_model_factory("MixtralForCausalLM")
    config = _hf_model(directory).config
    dropped = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    weights = [
        (name, tensor)
        for name, tensor in iter_weights(ModelSource(str(directory), is_gguf=False), config)
        if name != dropped
    ]
    assert len(weights) == len(list(iter_weights(ModelSource(str(directory), False), config))) - 1
    with pytest.raises(ValueError, match=r"layer 1's expert weights.*\(2, 'up'\)"):
        _build(config).load_weights(weights)


def test_unsupported_settings_are_refused():
    config = _block_config("mixtral")
    config.hidden_act = "gelu"
    with pytest.raises(ValueError, match="only 'silu'"):
        mixtral_spec(config)
    with pytest.raises(ValueError, match="between 1 and the 4 experts"):
        MoESpec(4, 5, 64, 32, renormalize=True, weights_in_hidden_dtype=False)


def test_block_traces_whole_for_the_compiled_decode_step():
    # The compiled decode step traces the model with fullgraph=True: the routing-dependent
    # grouping must be one opaque op there, not a graph break.
    _, ours = _blocks("qwen3-norm", torch.float32)
    traced = torch.compile(ours, backend="eager", fullgraph=True, dynamic=True)
    for num_tokens in (1, 3):
        x = _hidden(num_tokens, torch.float32, seed=num_tokens)
        with torch.no_grad():
            assert torch.equal(traced(x), ours(x))
