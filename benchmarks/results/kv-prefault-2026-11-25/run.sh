#!/usr/bin/env bash
# The KV pool faulted in on idle CPU (PAGEDLLM_KV_PREFAULT=1, the default) against off
# (=0): W1 fp32 and gguf + fp16 KV, alternating processes, with vLLM CPU in the same
# sitting; server start-up; the step breakdown on a fresh pool. Run from the repo root:
#     benchmarks/results/kv-prefault-2026-11-25/run.sh OUT_DIR [ROUNDS]
set -uo pipefail
out=$(mkdir -p "${1:?OUT_DIR}" && cd "$1" && pwd)
rounds=${2:-2}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
py=$root/.venv/bin/python
peers=${PAGEDLLM_PEERS_DIR:-$HOME/.cache/pagedllm-peers}
w1=(-m pagedllm bench throughput --dataset-name file --dataset-path "$here/workload_64.jsonl"
  --num-prompts 64 --dtype float32)
vllm() {
  VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=2 \
  VLLM_USE_AOT_COMPILE=0 HF_HUB_OFFLINE=1 VLLM_TARGET_DEVICE=cpu \
  "$peers/vllm/venv/bin/python" -P "$root/benchmarks/peers/run_vllm_offline.py" \
    --model "$peers/models/SmolLM2-135M-Instruct-fp32-hf" --workload "$here/workload_64.jsonl" \
    --num-prompts 64 --output-json "$out/w1_vllm_$1.json" > "$out/w1_vllm_$1.log" 2>&1
  echo "vllm $1: $(grep -o '"requests_per_s": [0-9.]*' "$out/w1_vllm_$1.json")"
}
pd() {  # pd NAME PREFAULT ARGS...
  local name=$1 on=$2; shift 2
  (cd "$out" && PAGEDLLM_KV_PREFAULT=$on "$py" "$@" --output-json "$out/$name.json" \
    > "$out/$name.log" 2>&1)
  echo "$name: $(grep -o '"requests_per_s": [0-9.]*' "$out/$name.json")"
}
echo "== $(date +%T) W1"
vllm r0
for r in $(seq 1 "$rounds"); do
  for on in 0 1; do pd "w1_fp32_prefault${on}_r$r" $on "${w1[@]}"; done
  for on in 0 1; do
    pd "w1_gguf_kv16_prefault${on}_r$r" $on "${w1[@]}" --quantization gguf --kv-cache-dtype float16
  done
done
vllm r1
echo "== $(date +%T) start-up"
for r in $(seq 1 "$rounds"); do
  for on in 0 1; do
    (cd "$out" && PAGEDLLM_KV_PREFAULT=$on "$py" "$root/benchmarks/startup.py" --runs 3 \
      > "$out/startup_prefault${on}_r$r.txt" 2>&1)
    echo "startup prefault=$on r$r: $(tail -1 "$out/startup_prefault${on}_r$r.txt")"
  done
done
echo "== $(date +%T) steps on a fresh pool"
for r in $(seq 1 "$rounds"); do
  for on in 0 1; do
    (cd "$out" && PAGEDLLM_KV_PREFAULT=$on "$py" "$root/benchmarks/step_breakdown.py" \
      --output-json "$out/steps_fresh_prefault${on}_r$r.json" > "$out/steps_fresh_prefault${on}_r$r.log" 2>&1)
    echo "steps prefault=$on r$r:"; tail -3 "$out/steps_fresh_prefault${on}_r$r.log"
  done
done
echo "== $(date +%T) done"
