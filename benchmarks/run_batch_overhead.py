"""What the batch format costs: `pagedllm run-batch` against `LLM.chat` on the same chat
requests, on one engine in one process (default model).

The run-batch side is the whole command after the model load: read the input file, check
and convert every line with the server's code, one `LLM.generate`, build every response body
and write the output file. The `LLM.chat` side renders the same conversations and generates
with the same params. The time each spends outside its `LLM.generate` call is reported too;
run-batch's minus LLM.chat's (rendering) is the format's own work, steadier than a difference
of two wall times on a busy machine.
Greedy with ignore_eos, so both make exactly `--max-tokens` tokens per request; the prefix
cache is emptied before each run and the two alternate, round by round.

    .venv/bin/python -m benchmarks.run_batch_overhead [--num-requests 1000 --max-tokens 16
        --rounds 2 --output-json run_batch.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.openai.server_config import ServerConfig
from pagedllm.entrypoints.run_batch import (
    BatchRunner,
    DoneSet,
    read_requests,
    write_records,
)

SUBJECTS = ["the sea", "a cat", "Paris", "winter", "a robot", "coffee", "the moon", "trains"]


def conversations(num_requests: int) -> list[list[dict]]:
    """Short, distinct one-turn chats (10-20 prompt tokens before the template)."""
    return [
        [
            {
                "role": "user",
                "content": f"Request {i}: write one sentence about {SUBJECTS[i % len(SUBJECTS)]}.",
            }
        ]
        for i in range(num_requests)
    ]


def batch_lines(chats: list[list[dict]], max_tokens: int) -> list[str]:
    body = {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}
    return [
        json.dumps(
            {
                "custom_id": f"request-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {**body, "messages": messages},
            }
        )
        for i, messages in enumerate(chats)
    ]


class TimedLLM:
    """The LLM as BatchRunner uses it, timing its engine call: the rest of the run is the
    batch format's own work (reading, checking, rendering, bodies, writing)."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.llm_engine = llm.llm_engine
        self.generate_s = 0.0
        self._generate = llm.generate

    def generate(self, *args, **kwargs):
        started = time.perf_counter()
        outputs = self._generate(*args, **kwargs)
        self.generate_s += time.perf_counter() - started
        return outputs


def time_chat(llm: LLM, chats: list[list[dict]], max_tokens: int) -> tuple[float, float, int]:
    """(wall seconds, seconds outside LLM.generate (rendering), completion tokens)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    timed = TimedLLM(llm)
    llm.reset_prefix_cache()
    llm.generate = timed.generate  # LLM.chat renders, then calls generate: time that part
    try:
        started = time.perf_counter()
        outputs = llm.chat(chats, params, use_tqdm=False)
        seconds = time.perf_counter() - started
    finally:
        del llm.generate
    return seconds, seconds - timed.generate_s, sum(len(o.outputs[0].token_ids) for o in outputs)


def time_run_batch(llm: LLM, input_path: Path, output_path: Path) -> tuple[float, float, int]:
    """`run-batch` as its command runs it (`run_batch.run_batch`), minus the model load:
    (wall seconds, seconds outside LLM.generate, completion tokens)."""
    output_path.unlink(missing_ok=True)
    config = ServerConfig(served_model_names=("SmolLM2-135M-Instruct",))
    timed = TimedLLM(llm)
    llm.reset_prefix_cache()
    started = time.perf_counter()
    items = list(read_requests(input_path.read_text().splitlines(), DoneSet()))
    records = BatchRunner(timed, config, use_tqdm=False).run(items)
    write_records(str(output_path), records)
    seconds = time.perf_counter() - started
    bodies = [r["response"]["body"] for r in records if r["response"]["status_code"] == 200]
    assert len(bodies) == len(items), "every request must be answered"
    tokens = sum(b["usage"]["completion_tokens"] for b in bodies)
    return seconds, seconds - timed.generate_s, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    chats = conversations(args.num_requests)
    llm = LLM(max_num_seqs=args.max_num_seqs)
    time_chat(llm, chats[:32], args.max_tokens)  # warm-up: kernels, page faults
    runs: dict[str, list[float]] = {
        "chat": [],
        "run_batch": [],
        "chat_outside_generate": [],
        "run_batch_outside_generate": [],
    }
    with tempfile.TemporaryDirectory() as folder:
        input_path, output_path = Path(folder) / "in.jsonl", Path(folder) / "out.jsonl"
        input_path.write_text("\n".join(batch_lines(chats, args.max_tokens)) + "\n")
        for round_index in range(args.rounds):
            # Alternate which goes first, so drift over the sitting does not favour one.
            order = ["chat", "run_batch"] if round_index % 2 == 0 else ["run_batch", "chat"]
            for name in order:
                if name == "chat":
                    seconds, outside, tokens = time_chat(llm, chats, args.max_tokens)
                else:
                    seconds, outside, tokens = time_run_batch(llm, input_path, output_path)
                runs[f"{name}_outside_generate"].append(outside)
                assert tokens == args.num_requests * args.max_tokens
                runs[name].append(seconds)
                print(f"round {round_index} {name}: {seconds:.2f} s ({tokens} tokens)")
    chat_s, batch_s = statistics.median(runs["chat"]), statistics.median(runs["run_batch"])
    result = {
        "num_requests": args.num_requests,
        "max_tokens": args.max_tokens,
        "max_num_seqs": args.max_num_seqs,
        "runs_s": runs,
        "chat_median_s": chat_s,
        "run_batch_median_s": batch_s,
        "overhead_pct": 100.0 * (batch_s - chat_s) / chat_s,
        # The format's own work: what run-batch does outside the engine call beyond what
        # LLM.chat does outside it (rendering), against LLM.chat's wall time.
        "format_work_s": statistics.median(runs["run_batch_outside_generate"])
        - statistics.median(runs["chat_outside_generate"]),
        "format_work_pct": 100.0
        * (
            statistics.median(runs["run_batch_outside_generate"])
            - statistics.median(runs["chat_outside_generate"])
        )
        / chat_s,
    }
    print(json.dumps(result, indent=2))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
