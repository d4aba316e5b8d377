"""What does detokenization cost per output token through tokenizers' DecodeStream and
through the window decoder (two `tokenizer.decode` calls a step), in the detokenizer alone
and in the frontend's whole per-step work (`OutputProcessor.process`, streamed deltas, with
and without logprobs' token strings)?

    .venv/bin/python -m benchmarks.detokenize [--requests 256 --tokens 256 --repeats 5]
        [--tokenizer smollm2|gemma3]

Each request's output is a 256-token slice of the repository's docs with multilingual text
mixed in (seed 0), after a 32-token prompt; tokens arrive one per request per step, the
requests interleaved as the engine's steps interleave them.
"""

from __future__ import annotations

import argparse
import functools
import random
import time
from pathlib import Path
from typing import Any

from benchmarks.timing import median_seconds
from pagedllm.core.messages import EngineCoreOutput, EngineCoreRequest, TokenLogprob
from pagedllm.frontend import output_processor
from pagedllm.frontend.detokenizer import IncrementalDetokenizer
from pagedllm.frontend.output_processor import OutputProcessor
from pagedllm.frontend.token_decoder import token_text_decoder
from pagedllm.model.gguf_loader import load_gguf_tokenizer
from pagedllm.model.loader import default_model_path, gemma3_270m_path
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

MULTILINGUAL = "日本語のテキスト、中文文本 — naïve café, “quoted” 🎉👍🏽 Ⅻ ½ 𓀀 "
STOP = ["\n\n\n\n", "</answer>"]
PATHS = {"window": False, "decode_stream": True}


def workload(tokenizer: Any, requests: int, tokens: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, output ids) per request, slices of a corpus with many multi-byte chars."""
    docs = sorted(Path(__file__).resolve().parent.parent.joinpath("docs").glob("*.md"))
    paragraphs = "\n\n".join(path.read_text() for path in docs).split("\n\n")
    corpus = "\n\n".join(MULTILINGUAL + paragraph for paragraph in paragraphs)
    ids = tokenizer.encode(corpus, add_special_tokens=False)
    rng = random.Random(0)
    pairs = []
    for _ in range(requests):
        start = rng.randrange(len(ids) - tokens - 32)
        pairs.append((ids[start : start + 32], ids[start + 32 : start + 32 + tokens]))
    return pairs


def run_detokenizers(tokenizer: Any, pairs, use_decode_stream: bool, stop) -> list[str]:
    detoks = [
        IncrementalDetokenizer(tokenizer, prompt, stop=stop, use_decode_stream=use_decode_stream)
        for prompt, _ in pairs
    ]
    texts = [""] * len(pairs)
    for step in range(len(pairs[0][1])):
        for index, (detok, (_, output)) in enumerate(zip(detoks, pairs, strict=True)):
            if not detok.finished:
                detok.update(output[step : step + 1])
                texts[index] += detok.get_next_delta()
    for index, detok in enumerate(detoks):
        detok.finish()
        texts[index] += detok.get_next_delta()
    return texts


def run_output_processor(tokenizer: Any, pairs, use_decode_stream: bool, logprobs: int) -> int:
    """The frontend's per-step work for the whole run (each token with ``logprobs``
    alternatives, whose strings it decodes); returns the outputs it produced."""
    output_processor.IncrementalDetokenizer = functools.partial(
        IncrementalDetokenizer, use_decode_stream=use_decode_stream
    )
    if not use_decode_stream:  # the logprobs' strings as before: tokenizer.decode([id])
        output_processor.token_text_decoder = lambda tok: lambda i: tok.decode([i])
    try:
        processor = OutputProcessor(tokenizer)
        params = SamplingParams(
            max_tokens=len(pairs[0][1]),
            output_kind=RequestOutputKind.DELTA,
            logprobs=logprobs or None,
        )
        for index, (prompt, _) in enumerate(pairs):
            request = EngineCoreRequest(f"r{index}", prompt, params, [], time.monotonic())
            processor.add_request(request, None)
        num_outputs, num_steps = 0, len(pairs[0][1])
        for step in range(num_steps):
            last = step == num_steps - 1
            outputs = [
                EngineCoreOutput(
                    f"r{index}",
                    output[step : step + 1],
                    last,
                    new_logprobs=_logprobs(output, step, logprobs),
                )
                for index, (_, output) in enumerate(pairs)
            ]
            num_outputs += len(processor.process(outputs)[0])
        return num_outputs
    finally:
        output_processor.IncrementalDetokenizer = IncrementalDetokenizer
        output_processor.token_text_decoder = token_text_decoder


def _logprobs(output: list[int], step: int, logprobs: int) -> list[TokenLogprob] | None:
    """The sampled token at rank 1 and the next tokens of the output as alternatives."""
    if not logprobs:
        return None
    top_ids = output[step : step + logprobs]
    return [(-0.5, 1, top_ids, [-0.5 - i for i in range(len(top_ids))])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokenizer", choices=["smollm2", "gemma3"], default="smollm2")
    args = parser.parse_args()
    path = default_model_path() if args.tokenizer == "smollm2" else gemma3_270m_path()
    tokenizer = load_gguf_tokenizer(path)
    pairs = workload(tokenizer, args.requests, args.tokens)
    num_tokens = args.requests * args.tokens

    texts = {name: run_detokenizers(tokenizer, pairs, flag, None) for name, flag in PATHS.items()}
    assert texts["window"] == texts["decode_stream"], "the two paths must give the same text"
    for text, (_, output) in zip(texts["window"], pairs, strict=True):
        full = tokenizer.decode(output)
        # A slice may start inside a character; the rest is the full decode's.
        assert "\ufffd" in full or text == full

    print(
        f"{args.tokenizer}: {args.requests} requests x {args.tokens} tokens, median of "
        f"{args.repeats}; microseconds per output token"
    )
    print("| case | window | decode_stream | speed-up |")
    print("|---|---|---|---|")
    cases = {
        "detokenizer, no stop strings": lambda flag: run_detokenizers(tokenizer, pairs, flag, None),
        "detokenizer, 2 stop strings": lambda flag: run_detokenizers(tokenizer, pairs, flag, STOP),
        "OutputProcessor.process (delta outputs)": lambda flag: run_output_processor(
            tokenizer, pairs, flag, 0
        ),
        "OutputProcessor.process, logprobs=5": lambda flag: run_output_processor(
            tokenizer, pairs, flag, 5
        ),
    }
    for case, run in cases.items():
        micros = {
            name: median_seconds(functools.partial(run, flag), args.repeats) / num_tokens * 1e6
            for name, flag in PATHS.items()
        }
        speedup = micros["window"] / micros["decode_stream"]
        print(
            f"| {case} | {micros['window']:.2f} | {micros['decode_stream']:.2f} | {speedup:.2f}x |"
        )


if __name__ == "__main__":
    main()
