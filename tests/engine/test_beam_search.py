"""Beam search equals a brute-force beam search written plainly on Transformers' logits,
ranked and returned as vLLM's `LLM.beam_search` does (prompt included)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedllm import LLM, BeamSearchParams


def plain_beam_search(model, prompt, width, max_tokens, eos_ids, length_penalty):
    """Every live beam proposes its 2 * width most likely tokens; the best `width` survive."""
    live, done = [([], 0.0)], []
    for _ in range(max_tokens):
        candidates = []
        for tokens, score in live:
            with torch.no_grad():
                logits = model(torch.tensor([prompt + tokens])).logits[0, -1]
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            values, ids = logprobs.topk(2 * width)
            for value, token in zip(values.tolist(), ids.tolist(), strict=True):
                beam = ([*tokens, token], score + value)
                (done if token in eos_ids else candidates).append(beam)
        live = sorted(candidates, key=lambda b: -b[1])[:width]

    def score(beam):  # vLLM's: over the prompt's tokens too, a final EOS not counted
        tokens, cum_logprob = beam
        length = len(prompt) + len(tokens) - (1 if tokens[-1] in eos_ids else 0)
        return cum_logprob / length**length_penalty

    return sorted(done + live, key=score, reverse=True)[:width]


@pytest.mark.parametrize(("width", "length_penalty", "eos"), [(3, 1.0, None), (2, 0.5, "top")])
def test_beams_and_scores_match_a_plain_search(tiny_llama, width, length_penalty, eos):
    hf_model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    prompt = [5, 17, 99, 230, 41, 8, 300]
    llm = LLM(str(tiny_llama), max_model_len=64, block_size=4)
    eos_ids = set()
    if eos == "top":
        # Make a token the model likes the EOS, so some beams finish early.
        with torch.no_grad():
            first = hf_model(torch.tensor([prompt])).logits[0, -1].topk(3).indices.tolist()
        eos_ids = {first[1]}
        llm.llm_engine.model_config.__dict__["eos_token_ids"] = frozenset(eos_ids)
    params = BeamSearchParams(beam_width=width, max_tokens=6, length_penalty=length_penalty)
    (output,) = llm.beam_search([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    expected = plain_beam_search(hf_model, prompt, width, 6, eos_ids, length_penalty)
    assert [s.tokens for s in output.sequences] == [prompt + tokens for tokens, _ in expected]
    for sequence, (tokens, score) in zip(output.sequences, expected, strict=True):
        assert sequence.cum_logprob == pytest.approx(score, abs=1e-4)
        assert len(sequence.logprobs) == len(tokens)
        assert all(token in step for token, step in zip(tokens, sequence.logprobs, strict=True))
        assert sequence.text == llm.get_tokenizer().decode(prompt + tokens)
    if eos == "top":
        assert any(s.tokens[-1] in eos_ids for s in output.sequences)
    llm.llm_engine.engine_core.check_integrity()


def test_beams_share_prefix_blocks(tiny_llama):
    llm = LLM(str(tiny_llama), max_model_len=64, block_size=4)
    prompt = {"prompt_token_ids": list(range(3, 23))}
    llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=5), use_tqdm=False)
    stats = llm.get_stats()
    # After the first step every beam request reuses the prompt's full blocks.
    assert stats.prefix_cache_hits >= 4 * 16
    assert stats.num_computed_prompt_tokens < 20 + 4 * 3 * 24


def test_beam_width_above_max_logprobs_is_refused(tiny_llama):
    llm = LLM(str(tiny_llama), max_model_len=64)
    with pytest.raises(ValueError, match="beam_width=11"):
        llm.beam_search(["x"], BeamSearchParams(beam_width=11, max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=2)
