"""LLM() start-up with the KV prefault beside it: seconds in the model load, in the weights'
copy to huge pages, in the whole LLM(), and GB of the pool faulted in when LLM() returns.
`--chunk-bytes` overrides kv_prefault.CHUNK_BYTES (2 MB and 256 KB were compared).
    [PAGEDLLM_KV_PREFAULT=0] .venv/bin/python init_beside_prefault.py [--chunk-bytes N]
"""

import argparse
import json
import time

from pagedllm.worker import kv_prefault
from pagedllm.worker import model_runner as mr

parser = argparse.ArgumentParser()
parser.add_argument("--chunk-bytes", type=int, default=kv_prefault.CHUNK_BYTES)
kv_prefault.CHUNK_BYTES = parser.parse_args().chunk_bytes
seconds = {}


def timed(name, function):
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        result = function(*args, **kwargs)
        seconds[name] = time.perf_counter() - started
        return result

    return wrapper


mr.ModelRunner._load_model = timed("load", mr.ModelRunner._load_model)
mr.place_weights_on_huge_pages = timed("huge_pages", mr.place_weights_on_huge_pages)
from pagedllm.llm import LLM  # noqa: E402

llm = timed("init", LLM)(dtype="float32")
prefaulter = llm.llm_engine.engine_core.model_runner._prefaulter
seconds["gb"] = prefaulter.populated_bytes / 1e9 if prefaulter else 0.0
print(json.dumps({name: round(value, 2) for name, value in seconds.items()}))
