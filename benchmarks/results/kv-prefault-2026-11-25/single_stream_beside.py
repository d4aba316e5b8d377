"""Single-stream decode beside the KV prefault: N greedy requests of 128 tokens from a
1-token prompt in one engine, seconds each, and (with the thread on) the GB of the pool
faulted in so far, `*` once the thread has finished.
    [PAGEDLLM_KV_PREFAULT=0] .venv/bin/python single_stream_beside.py N"""

import sys
import time

from pagedllm.llm import LLM
from pagedllm.sampling_params import SamplingParams

llm = LLM(dtype="float32")
prefaulter = llm.llm_engine.engine_core.model_runner._prefaulter
params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
cells = []
for _ in range(int(sys.argv[1])):
    started = time.perf_counter()
    llm.generate({"prompt_token_ids": [1]}, params, use_tqdm=False)
    cell = f"{time.perf_counter() - started:.2f}"
    if prefaulter is not None:
        done = "*" if prefaulter.finished.is_set() else ""
        cell += f"({prefaulter.populated_bytes / 1e9:.1f}{done})"
    cells.append(cell)
print(" ".join(cells))
