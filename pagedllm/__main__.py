from pagedllm.entrypoints.cli import run

run()
