"""Phi-3: greedy tokens equal Transformers' with LongRoPE's long factors (the short side is the
shared `Phi3ForCausalLM:longrope` case of tests/engine/test_greedy_vs_transformers.py), the
fused checkpoint tensors fill every tensor-parallel rank reading only its rows, the sliding
window reaches every layer, and unsupported configs are refused."""

from __future__ import annotations

import pytest
import torch
from model_utils import compare_greedy, hf_greedy, make_tiny_model
from transformers import AutoModelForCausalLM, Phi3Config
from transformers import Phi3ForCausalLM as HfPhi3ForCausalLM

from pagedllm import LLM, SamplingParams
from pagedllm.distributed import parallel_state
from pagedllm.model.models.llama import LlamaForCausalLM
from pagedllm.model.models.phi3 import Phi3ForCausalLM, split_fused_weights
from pagedllm.model.registry import resolve_model_class
from pagedllm.ops.attention_registry import get_attention_backend

TIE_TOLERANCE = 1e-4
ORIGINAL = 32
MAX_MODEL_LEN = 128
PROMPT_LENGTHS = (33, 47, 70, 90)  # all beyond the original context: Transformers goes long
MAX_NEW_TOKENS = 24
SHORT_FACTOR = [1.0, 1.25, 1.5, 2.0, 3.0, 4.0]
LONG_FACTOR = [2.0, 3.0, 4.5, 6.0, 8.0, 12.0]


def _long_context(long_factor: list[float]) -> dict:
    """Phi-4-mini's shape of LongRoPE (3/4 of each head) with a 32-token original context."""
    return {
        "partial_rotary_factor": 0.75,
        "original_max_position_embeddings": ORIGINAL,
        "rope_parameters": {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": SHORT_FACTOR,
            "long_factor": long_factor,
        },
    }


def _references(directory, prompts: list[list[int]]):
    hf_model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    return [hf_greedy(hf_model, p, MAX_NEW_TOKENS) for p in prompts]


def test_long_factors_greedy_matches_transformers(tmp_path, report_ties):
    """max_model_len 128 > 32: the engine runs the long factors everywhere, as Transformers
    does for prompts longer than the original context (prefill and every decode step)."""
    directory = make_tiny_model("Phi3ForCausalLM", tmp_path / "long", **_long_context(LONG_FACTOR))
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    references = _references(directory, prompts)
    # The comparison can tell the two sets apart: the short factors give other tokens.
    short_only = make_tiny_model(
        "Phi3ForCausalLM", tmp_path / "short", **_long_context(SHORT_FACTOR)
    )
    assert [r.token_ids for r in _references(short_only, prompts)] != [
        r.token_ids for r in references
    ]

    llm = LLM(
        str(directory),
        max_model_len=MAX_MODEL_LEN,
        block_size=7,
        max_num_batched_tokens=32,  # chunked prefill: chunks below position 32 run long too
        kv_cache_memory="8MiB",
    )
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts]
    ties = 0
    for _ in range(2):  # the second pass starts from the prefix cache
        outputs = llm.generate(batch, params, use_tqdm=False)
        ties += sum(
            compare_greedy(out.outputs[0].token_ids, ref, TIE_TOLERANCE)
            for out, ref in zip(outputs, references, strict=True)
        )
    assert llm.llm_engine.engine_core.kv_cache_manager.prefix_cache_stats.hits > 0
    report_ties(ties, 2 * len(prompts))


def _tiny_config(**overrides) -> Phi3Config:
    settings = dict(
        architectures=["Phi3ForCausalLM"],
        vocab_size=512,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return Phi3Config(**{**settings, **overrides})


def _build(model_class, config):
    return model_class(config, get_attention_backend("torch"), torch.float32, 64)


class RecordingSlice:
    """A lazy checkpoint tensor (as `model/loader.py`'s CheckpointSlice) that counts the rows
    read from it."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.shape, self.rows_read = tensor, tuple(tensor.shape), 0

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        part = self.tensor.narrow(dim, start, length)
        self.rows_read += part.shape[0]
        return part.clone()

    def materialize(self) -> torch.Tensor:
        self.rows_read += self.shape[0]
        return self.tensor.clone()


def _llama_names(state: dict[str, torch.Tensor], config: Phi3Config) -> dict:
    """The same weights as a Llama checkpoint names them, cut as Transformers' Phi-3 cuts its
    fused outputs (q, k, v by head counts; gate and up by halves)."""
    head_dim = config.hidden_size // config.num_attention_heads
    q_rows = config.num_attention_heads * head_dim
    kv_rows = config.num_key_value_heads * head_dim
    out = {}
    for name, tensor in state.items():
        if "qkv_proj" in name:
            q, k, v = tensor.split([q_rows, kv_rows, kv_rows])
            out |= {
                name.replace("qkv_proj", p): t
                for p, t in zip(("q_proj", "k_proj", "v_proj"), (q, k, v), strict=True)
            }
        elif "gate_up_proj" in name:
            gate, up = tensor.chunk(2)
            out |= {
                name.replace("gate_up_proj", "gate_proj"): gate,
                name.replace("gate_up_proj", "up_proj"): up,
            }
        else:
            out[name] = tensor
    return out


@pytest.mark.parametrize("num_kv_heads", [1, 2])  # 1: replicated over the two ranks
@pytest.mark.parametrize("rank", [0, 1])
def test_fused_checkpoint_fills_each_tensor_parallel_rank_from_its_rows(
    monkeypatch, rank, num_kv_heads
):
    config = _tiny_config(num_key_value_heads=num_kv_heads)
    torch.manual_seed(0)
    state = HfPhi3ForCausalLM(config).state_dict()
    monkeypatch.setattr(
        parallel_state, "_TP", parallel_state.GroupCoordinator([0, 1], rank, torch.device("cpu"))
    )
    lazy = {name: RecordingSlice(tensor) for name, tensor in state.items()}
    phi3 = _build(Phi3ForCausalLM, config)
    phi3.load_weights(lazy.items())
    reference = _build(LlamaForCausalLM, config)
    reference.load_weights(_llama_names(state, config).items())

    expected = dict(reference.named_parameters())
    for name, param in phi3.named_parameters():
        assert torch.equal(param, expected[name]), name
    for name, source in lazy.items():
        if "qkv_proj" in name or "gate_up_proj" in name:
            rank_rows = dict(phi3.named_parameters())[name].shape[0]
            assert source.rows_read == rank_rows < source.shape[0], name


def test_fused_tensor_of_the_wrong_size_is_refused():
    config = _tiny_config()
    weights = [("model.layers.0.self_attn.qkv_proj.weight", torch.zeros(100, 64))]
    with pytest.raises(ValueError, match="has 100 rows; the config gives 128"):
        list(split_fused_weights(weights, config))


@pytest.mark.parametrize("window", [None, 200])
def test_sliding_window_reaches_every_layer(window):
    assert resolve_model_class(["Phi3ForCausalLM"]) is Phi3ForCausalLM
    model = _build(Phi3ForCausalLM, _tiny_config(sliding_window=window))
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [window] * 2


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
            "Phi-3 rope_type 'linear' is not supported",
        ),
        ({"attention_bias": True}, "Phi-3 has no biases"),
        ({"hidden_act": "gelu_new"}, "hidden_act 'gelu_new' is not supported"),
        ({"partial_rotary_factor": 0.6}, "rotates 9 of 16 dimensions"),
        (
            {
                "rope_parameters": {
                    "rope_type": "longrope",
                    "rope_theta": 1e4,
                    "short_factor": [1.0],
                }
            },
            "longrope short_factor must list 8 factors",
        ),
    ],
)
def test_unsupported_configs_are_refused(change, message):
    config = _tiny_config()
    for field, value in change.items():
        setattr(config, field, value)
    if "partial_rotary_factor" in change:
        config.rope_parameters["partial_rotary_factor"] = change["partial_rotary_factor"]
    with pytest.raises(ValueError, match=message):
        _build(Phi3ForCausalLM, config)
