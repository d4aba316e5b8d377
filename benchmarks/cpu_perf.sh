#!/usr/bin/env bash
# The CPU performance targets in one run, side by side (benchmarks/results/steps.md and the
# pages it links): the working tree ("after") against BASE ("before", default c5b3781, the
# last commit before the fused CPU kernels), vLLM CPU and llama.cpp from benchmarks.compare's
# peers (install them first: `.venv/bin/python -m benchmarks.compare --install-only`).
#
#     benchmarks/cpu_perf.sh OUT_DIR [BASE_COMMIT]      # about 40 minutes on 2 cores
#     SECTIONS="w1 single" benchmarks/cpu_perf.sh OUT_DIR [BASE_COMMIT]   # some of them
#
# Sections: steps, w1, quantized, budget, kv, single, startup (default: all).
# "before" runs from a git worktree of BASE with its own extension cache, so the working
# tree's compiled kernels are left alone. Each step writes its JSON/text under OUT_DIR.
# Afterwards: `git worktree remove --force OUT_DIR/before-src` drops that worktree.
set -euo pipefail

out=$(mkdir -p "${1:?usage: cpu_perf.sh OUT_DIR [BASE_COMMIT]}" && cd "$1" && pwd)
base=${2:-c5b3781}
root=$(cd "$(dirname "$0")/.." && pwd)
py=$root/.venv/bin/python
peers=${PAGEDLLM_PEERS_DIR:-$HOME/.cache/pagedllm-peers}
before=$out/before-src
[ -d "$before" ] || git -C "$root" worktree add --force --detach "$before" "$base"
grep -m1 '^flags' /proc/cpuinfo > "$out/cpu_flags.txt"

# Run from OUT_DIR so neither tree is importable from the working directory. The benchmarks
# package is always the working tree's, found through a folder that holds nothing else, so
# "before" takes only pagedllm from its worktree (which has a benchmarks/ of its own).
mkdir -p "$out/path" && ln -sfn "$root/benchmarks" "$out/path/benchmarks"
after() { (cd "$out" && PYTHONPATH=$out/path "$@"); }
before() { (cd "$out" && PAGEDLLM_CACHE_DIR=$out/before-cache PYTHONPATH=$out/path:$before "$@"); }
step() { echo "== $(date +%T) $*"; }
want() { [[ " ${SECTIONS:-all} " == *" all "* || " ${SECTIONS:-all} " == *" $1 "* ]]; }

if want steps; then
step "step breakdown at batch 256 (decode) and in 2,048-token chunks (prefill)"
for side in before after; do
  $side "$py" -m benchmarks.step_breakdown --profile "$out/decode_profile_$side.txt" \
    --profile-prefill "$out/prefill_profile_$side.txt" --output-json "$out/steps_$side.json" \
    > "$out/steps_$side.log" 2>&1
  tail -4 "$out/steps_$side.log"
done
step "the same with the KV pool's pages faulted in first (a server's steady state)"
for side in before after; do
  $side "$py" -m benchmarks.step_breakdown --populate-kv-cache \
    --output-json "$out/steps_populated_$side.json" > "$out/steps_populated_$side.log" 2>&1
  tail -2 "$out/steps_populated_$side.log"
done
after "$py" -m benchmarks.step_breakdown --populate-kv-cache --kv-cache-dtype float16 \
  --output-json "$out/steps_populated_kv_fp16.json" > "$out/steps_populated_kv_fp16.log" 2>&1
tail -2 "$out/steps_populated_kv_fp16.log"
fi

w1=(bench throughput --dataset-name file --dataset-path "$out/w1/workload_64.jsonl"
  --num-prompts 64 --dtype float32 --no-compile)
if want w1; then
step "W1 offline: pagedllm and vLLM CPU (compare.py), then pagedllm before"
after "$py" -m benchmarks.compare --only pagedllm,vllm --num-prompts 64 \
  --skip-serve --skip-ceiling --out-dir "$out/w1" > "$out/w1.log" 2>&1
before "$py" -m pagedllm "${w1[@]}" --output-json "$out/w1_before.json" > "$out/w1_before.log" 2>&1
after "$py" -m pagedllm "${w1[@]}" --compile --output-json "$out/w1_compile.json" \
  > "$out/w1_compile.log" 2>&1
after "$py" -m pagedllm "${w1[@]}" --kv-cache-dtype float16 --output-json "$out/w1_kv_fp16.json" \
  > "$out/w1_kv_fp16.log" 2>&1
fi

if want quantized; then
step "W1 with --quantization int8 and gguf, and their accuracy"
for q in int8 gguf; do
  after "$py" -m pagedllm "${w1[@]}" --quantization "$q" --output-json "$out/w1_$q.json" \
    > "$out/w1_$q.log" 2>&1
done
after "$py" -m pagedllm "${w1[@]}" --quantization gguf --kv-cache-dtype float16 \
  --output-json "$out/w1_gguf_kv_fp16.json" > "$out/w1_gguf_kv_fp16.log" 2>&1
after "$py" -m benchmarks.int8_speed w1 --rounds 1 --variants fp32,int8,gguf \
  --output-json "$out/int8_speed.json" > "$out/int8_speed.log" 2>&1
after "$py" -m benchmarks.int8_accuracy --output-json "$out/int8_accuracy.json" \
  > "$out/int8_accuracy.log" 2>&1
fi

if want budget; then
step "scheduler budget on W1: 1,024 and 4,096 tokens per step (2,048 is the W1 run above)"
for budget in 1024 4096; do
  after "$py" -m pagedllm "${w1[@]}" --max-num-batched-tokens "$budget" \
    --output-json "$out/w1_budget_$budget.json" > "$out/w1_budget_$budget.log" 2>&1
done
fi

if want kv; then
step "KV waste on W1"
after "$py" -m benchmarks.kv_waste --output-json "$out/kv_waste.json" > "$out/kv_waste.log" 2>&1
fi

if want single; then
step "skinny linear at 1..128 rows (before, after)"
for side in before after; do
  $side "$py" -m benchmarks.skinny_linear --rows 1,2,4,8,16,32,64,96,128 \
    > "$out/skinny_$side.log" 2>&1
done
step "single-stream decode: pagedllm (before, after) and llama.cpp F32 tg128"
latency=(bench latency --batch-size 1 --input-len 1 --output-len 128 --num-iters 5
  --num-iters-warmup 1 --dtype float32 --no-compile)
for side in before after; do
  $side "$py" -m pagedllm "${latency[@]}" --output-json "$out/latency_$side.json" \
    > "$out/latency_$side.log" 2>&1
done
for flags in "--compile" "--quantization gguf" "--quantization gguf --compile"; do
  name=latency$(echo " $flags" | sed 's/ --quantization /_/; s/ --/_/g')
  # shellcheck disable=SC2086
  after "$py" -m pagedllm "${latency[@]}" $flags --output-json "$out/$name.json" \
    > "$out/$name.log" 2>&1
done
after "$py" -m benchmarks.step_breakdown --quantization gguf \
  --profile "$out/decode_profile_gguf.txt" --output-json "$out/steps_gguf.json" \
  > "$out/steps_gguf.log" 2>&1
"$peers/llama.cpp/build/bin/llama-bench" -m "$peers/models/SmolLM2-135M-Instruct-f32.gguf" \
  -p 0 -n 128 -t 2 -r 5 -o json > "$out/llama_bench_tg128.json" 2> "$out/llama_bench.log"
fi

if want startup; then
step "server start-up, warm cache (eager; then --compile)"
after "$py" -m benchmarks.startup --runs 3 -- --no-compile > "$out/startup.log" 2>&1
tail -3 "$out/startup.log"
after "$py" -m benchmarks.startup --runs 2 -- --compile > "$out/startup_compile.log" 2>&1
tail -3 "$out/startup_compile.log"
fi
step "done: $out"
