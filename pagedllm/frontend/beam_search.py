"""Beam search on top of the engine: `LLM.beam_search(prompts, BeamSearchParams(...))`.

Each step asks the engine for one more token of every live beam, with the top
`2 * beam_width` logprobs; the best `beam_width` extensions by cumulative logprob live on.
Beams are sent as prompts that extend each other, so prefix caching lets them share their
full KV blocks by reference count; only a beam's partial last block is recomputed.
Finished beams (EOS unless `ignore_eos`, or `max_tokens`) are ranked as vLLM ranks them:
`cum_logprob / len(tokens) ** length_penalty`, `tokens` being the prompt's and the beam's
(a final EOS not counted). A sequence is what vLLM's `LLM.beam_search` returns: its tokens
and text start with the prompt's, `logprobs` holds each generated token's candidates.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from pagedllm.lora.request import LoRARequest
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from pagedllm.frontend.llm_engine import LLMEngine
    from pagedllm.outputs import PositionLogprobs, RequestOutput

# `LLM.generate`: the beams of a step go through the engine as ordinary requests.
Generate = Callable[..., list["RequestOutput"]]


@dataclass(frozen=True)
class BeamSearchParams:
    """beam_width: beams kept per step; max_tokens: most tokens per beam; ignore_eos: keep
    beams going past EOS; temperature: of the step that proposes candidates (0: greedy);
    length_penalty: exponent of the length normalization of the final score."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be >= 1, got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")


@dataclass
class BeamSearchSequence:
    """One beam: `tokens` (the prompt's, then the beam's), each generated token's candidate
    logprobs, their sum `cum_logprob`, and `text`, the decoded `tokens`."""

    tokens: list[int]
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finished: bool = False

    def score(self, length_penalty: float, eos_ids: frozenset[int]) -> float:
        length = len(self.tokens) - (1 if self.finished and self.tokens[-1] in eos_ids else 0)
        return self.cum_logprob / max(1, length) ** length_penalty


@dataclass
class BeamSearchOutput:
    """The best `beam_width` sequences of one prompt, best first."""

    prompt_token_ids: list[int]
    sequences: list[BeamSearchSequence] = field(default_factory=list)


def beam_search(
    engine: LLMEngine,
    generate: Generate,
    prompts: list[Any],
    params: BeamSearchParams,
    use_tqdm: bool = True,
    lora_requests: list[LoRARequest | None] | None = None,
) -> list[BeamSearchOutput]:
    """`lora_requests`: each prompt's adapter (None: the base model's), for all its beams."""
    width = params.beam_width
    loras = lora_requests or [None] * len(prompts)
    if 2 * width > engine.model_config.max_logprobs:
        raise ValueError(
            f"beam_width={width} needs 2 * beam_width logprobs, above max_logprobs="
            f"{engine.model_config.max_logprobs} (an engine argument)"
        )
    prompt_ids = [engine.input_processor.process_prompt(prompt)[1] for prompt in prompts]
    live = [[BeamSearchSequence(list(ids))] for ids in prompt_ids]
    done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
    step_params = SamplingParams(
        temperature=params.temperature,
        max_tokens=1,
        logprobs=2 * width,
        ignore_eos=True,
        detokenize=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
    eos_ids = engine.model_config.eos_token_ids
    for _ in tqdm(range(params.max_tokens), desc="Beam search", disable=not use_tqdm):
        beams = [(i, beam) for i, beams in enumerate(live) for beam in beams]
        if not beams:
            break
        requests = [{"prompt_token_ids": beam.tokens} for _, beam in beams]
        outputs = generate(
            requests, step_params, use_tqdm=False, lora_request=[loras[i] for i, _ in beams]
        )
        candidates: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        for (i, beam), output in zip(beams, outputs, strict=True):
            candidates_here = output.outputs[0].logprobs[0]
            for token_id, logprob in candidates_here.items():
                extended = BeamSearchSequence(
                    [*beam.tokens, token_id],
                    [*beam.logprobs, candidates_here],
                    beam.cum_logprob + logprob.logprob,
                )
                if token_id in eos_ids and not params.ignore_eos:
                    extended.finished = True
                    done[i].append(extended)
                else:
                    candidates[i].append(extended)
        live = [sorted(c, key=lambda b: -b.cum_logprob)[:width] for c in candidates]
    return [
        _best(prompt_ids[i], done[i] + live[i], params, engine.tokenizer, eos_ids)
        for i in range(len(prompts))
    ]


def _best(
    prompt_token_ids, sequences, params: BeamSearchParams, tokenizer, eos_ids
) -> BeamSearchOutput:
    def score(beam: BeamSearchSequence) -> float:
        return beam.score(params.length_penalty, eos_ids)

    ranked = sorted(sequences, key=score, reverse=True)[: params.beam_width]
    for sequence in ranked:
        if tokenizer is not None:
            sequence.text = tokenizer.decode(sequence.tokens)
    return BeamSearchOutput(prompt_token_ids, ranked)
