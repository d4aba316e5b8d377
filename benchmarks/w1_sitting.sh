#!/usr/bin/env bash
# W1 against vLLM CPU in one sitting, beside the cores' arithmetic peak and the matmul rates:
# how the current throughput figure is measured (benchmarks/results/throughput.md). The peak
# (benchmarks.arithmetic_peak), the fp32 ceiling (benchmarks.ceiling) and the gguf kernel's
# rates (benchmarks.gguf_matmul, one and two digits) at the start and at the end; between
# them vLLM, then ROUNDS rounds of every pagedllm variant in alternating processes, then vLLM
# again. This machine's speed drifts by 10-20% from one minute to the next, so the ratios are
# taken within the sitting. vLLM comes from benchmarks.compare's peer cache, installed once
# with `.venv/bin/python -m benchmarks.compare --install-only --only vllm`. From anywhere:
#
#     benchmarks/w1_sitting.sh OUT_DIR [ROUNDS]        # about 7 minutes at 2 rounds
#     SECTIONS=w1 benchmarks/w1_sitting.sh OUT_DIR     # W1 only (sections: rates, w1)
#     VARIANTS="fp32_off PAGEDLLM_KV_PREFAULT=0;fp32_on" benchmarks/w1_sitting.sh OUT_DIR 5
#
# VARIANTS is ";"-separated; each is a name, then NAME=VALUE settings of the environment, then
# flags for `pagedllm bench throughput` (default: fp32, and gguf with a 16-bit KV cache).
# Every figure lands in OUT_DIR as JSON beside its log, with the CPU's flags (cpu_flags.txt).
set -uo pipefail

out=$(mkdir -p "${1:?usage: w1_sitting.sh OUT_DIR [ROUNDS]}" && cd "$1" && pwd)
rounds=${2:-2}
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"  # `python -m benchmarks.*` resolves from the repository root
py=$root/.venv/bin/python
peers=${PAGEDLLM_PEERS_DIR:-$HOME/.cache/pagedllm-peers}
variants=${VARIANTS:-"fp32;gguf_kv16 --quantization gguf --kv-cache-dtype float16"}
want() { [[ " ${SECTIONS:-all} " == *" all "* || " ${SECTIONS:-all} " == *" $1 "* ]]; }

grep -m1 '^flags' /proc/cpuinfo > "$out/cpu_flags.txt"
# benchmarks.compare's W1 file (random token ids, seed 0), read by every engine.
workload=$out/workload_64.jsonl
[ -f "$workload" ] || "$py" -c "from pathlib import Path
from benchmarks.peers.workload import Workload, write_workload
write_workload(Workload(64, 256, 128, Path('$workload')))"
w1=(-m pagedllm bench throughput --dataset-name file --dataset-path "$workload"
  --num-prompts 64 --dtype float32)
rate() { grep -o '"requests_per_s": [0-9.]*' "$1"; }

# vLLM's environment as benchmarks.compare sets it, not restated here.
vllm_env=$("$py" -c \
  'from benchmarks.peers.vllm_peer import VLLM_ENV; print(" ".join(f"{k}={v}" for k, v in VLLM_ENV.items()))')
vllm() {
  # shellcheck disable=SC2086
  env $vllm_env "$peers/vllm/venv/bin/python" -P "$root/benchmarks/peers/run_vllm_offline.py" \
    --model "$peers/models/SmolLM2-135M-Instruct-fp32-hf" --workload "$workload" \
    --num-prompts 64 --output-json "$out/w1_vllm_$1.json" > "$out/w1_vllm_$1.log" 2>&1
  echo "vllm $1: $(rate "$out/w1_vllm_$1.json")"
}
pd() {  # pd NAME [NAME=VALUE ...] [FLAGS ...]: one pagedllm W1 run
  local name=$1 settings=() flags=() word
  shift
  for word in "$@"; do
    if [[ $word == [A-Za-z_]*=* ]]; then settings+=("$word"); else flags+=("$word"); fi
  done
  (cd "$out" && env "${settings[@]}" "$py" "${w1[@]}" "${flags[@]}" \
    --output-json "$out/$name.json" > "$out/$name.log" 2>&1)
  echo "$name: $(rate "$out/$name.json")"
}
rates() {  # rates TAG: the peak loops and the matmul rates
  "$py" -m benchmarks.arithmetic_peak --json "$out/peak_$1.json" | tee "$out/peak_$1.txt"
  "$py" -m benchmarks.ceiling | tee "$out/ceiling_$1.txt"
  for digits in 2 1; do
    "$py" -m benchmarks.gguf_matmul --rows 1,64,256,2048 --digits "$digits" \
      | tee "$out/gguf_matmul_${digits}digit_$1.txt"
  done
}

if want rates; then echo "== $(date +%T) rates"; rates start; fi
if want w1; then
  echo "== $(date +%T) W1"
  IFS=';' read -ra variant_list <<< "$variants"
  vllm r0
  for r in $(seq 1 "$rounds"); do
    for variant in "${variant_list[@]}"; do
      # shellcheck disable=SC2086
      set -- $variant
      name=$1
      shift
      pd "w1_${name}_r$r" "$@"
    done
  done
  vllm r1
fi
if want rates; then echo "== $(date +%T) rates"; rates end; fi
echo "== $(date +%T) done: $out"
