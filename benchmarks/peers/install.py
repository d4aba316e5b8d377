"""Which install steps each engine needs, run once each, failures kept per engine.

Steps are idempotent (stamp files under the cache root); a failed step fails only the
engines that need it, with the step's error text as the reason the report shows.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from benchmarks.peers import guidellm_peer, llamacpp, models, vllm_peer
from benchmarks.peers.common import PeerPaths, Runner, StepError, write_json

ENGINES = ("pagedllm", "vllm", "transformers", "llamacpp", "llamacpp-q4_1")
SERVE_ENGINES = ("pagedllm", "vllm", "llamacpp")
NEEDS: dict[str, tuple[str, ...]] = {
    "pagedllm": (),
    "transformers": ("hf-model",),
    "vllm": ("hf-model", "vllm-venv"),
    "llamacpp": ("llamacpp-source", "llamacpp-build", "hf-model", "gguf-f32"),
    "llamacpp-q4_1": ("llamacpp-source", "llamacpp-build"),
}
# Load generators run against a server (`benchmarks.load_generators`), not engines.
LOAD_GENERATOR_NEEDS: dict[str, tuple[str, ...]] = {
    "vllm-bench": ("vllm-venv",),
    "guidellm": ("guidellm-venv",),
}


def step_functions(build_jobs: int) -> dict[str, Callable[[PeerPaths, Runner], dict]]:
    return {
        "hf-model": models.export_hf_model,
        "vllm-venv": vllm_peer.install,
        "guidellm-venv": guidellm_peer.install,
        "llamacpp-source": llamacpp.fetch_source,
        "llamacpp-build": partial(llamacpp.build, jobs=build_jobs),
        "gguf-f32": llamacpp.convert_f32,
    }


def prepare(
    engines: list[str], paths: PeerPaths, runner: Runner, build_jobs: int = 2
) -> dict[str, str | None]:
    """Runs the steps the engines need; returns engine -> None (ready) or why it is not.

    Also writes every step's stamp or error to `install.json` in the results folder."""
    functions = step_functions(build_jobs)
    outcomes: dict[str, dict] = {}
    for engine in engines:
        for step in NEEDS[engine]:
            if step not in outcomes:
                outcomes[step] = run_step(step, functions[step], paths, runner)
    if not runner.dry_run:
        write_json(paths.out / "install.json", outcomes)
    return {engine: first_error(NEEDS[engine], outcomes) for engine in engines}


def prepare_load_generators(
    tools: list[str], paths: PeerPaths, runner: Runner
) -> dict[str, str | None]:
    """Runs the steps the load generators need; returns tool -> None (ready) or why not."""
    functions = step_functions(build_jobs=2)
    outcomes: dict[str, dict] = {}
    for tool in tools:
        for step in LOAD_GENERATOR_NEEDS[tool]:
            if step not in outcomes:
                outcomes[step] = run_step(step, functions[step], paths, runner)
    return {tool: first_error(LOAD_GENERATOR_NEEDS[tool], outcomes) for tool in tools}


def run_step(
    step: str, function: Callable[[PeerPaths, Runner], dict], paths: PeerPaths, runner: Runner
) -> dict:
    print(f"== install step {step}", flush=True)
    try:
        stamp = function(paths, runner)
    except (StepError, OSError, ValueError) as error:
        print(f"   failed: {error}", flush=True)
        return {"step": step, "error": str(error)}
    if stamp:
        print(f"   ready ({stamp.get('seconds')} s when it ran, {stamp.get('finished')})")
    return stamp


def first_error(steps: tuple[str, ...], outcomes: dict[str, dict]) -> str | None:
    for step in steps:
        error = outcomes[step].get("error")
        if error:
            return f"install step {step} failed: {error}"
    return None
