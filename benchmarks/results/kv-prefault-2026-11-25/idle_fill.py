"""How much of the KV pool is faulted in when LLM() returns, and how long an idle engine
takes to fault in the rest.    .venv/bin/python idle_fill.py"""

import time

from pagedllm.llm import LLM

started = time.perf_counter()
llm = LLM(dtype="float32")
init_s = time.perf_counter() - started
runner = llm.llm_engine.engine_core.model_runner
prefaulter = runner._prefaulter
pool_gb = sum(t.nbytes for pair in runner.kv_caches for t in pair) / 1e9
at_init_gb = prefaulter.populated_bytes / 1e9
prefaulter.finished.wait(120)
idle_s = time.perf_counter() - started - init_s
print(
    f"init {init_s:.2f} s; populated at init end {at_init_gb:.2f} GB; whole pool {pool_gb:.2f} "
    f"GB populated {prefaulter.populated_bytes / 1e9:.2f} GB after {idle_s:.1f} s more idle"
)
