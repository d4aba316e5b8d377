#!/usr/bin/env bash
# The cores' arithmetic peak beside the matmul rates and W1 with vLLM CPU, in one sitting:
# arithmetic_peak.py, ceiling.py and gguf_matmul.py (1 and 2 digits) at the start and the
# end; W1 fp32 and gguf + fp16 KV in alternating processes between vLLM runs. From the
# repo root:
#     benchmarks/results/arithmetic-peak-2026-11-25/run.sh OUT_DIR [ROUNDS]
set -uo pipefail
out=$(mkdir -p "${1:?OUT_DIR}" && cd "$1" && pwd)
rounds=${2:-2}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
py=$root/.venv/bin/python
peers=${PAGEDLLM_PEERS_DIR:-$HOME/.cache/pagedllm-peers}
workload=$root/benchmarks/results/kv-prefault-2026-11-25/workload_64.jsonl
w1=(-m pagedllm bench throughput --dataset-name file --dataset-path "$workload"
  --num-prompts 64 --dtype float32)
rate() { grep -o '"requests_per_s": [0-9.]*' "$1"; }
# vLLM's environment as compare.py sets it (peers/vllm_peer.py), not restated here.
vllm_env=$(cd "$root/benchmarks" && "$py" -c \
  'from peers.vllm_peer import VLLM_ENV; print(" ".join(f"{k}={v}" for k, v in VLLM_ENV.items()))')
vllm() {
  env $vllm_env "$peers/vllm/venv/bin/python" -P "$root/benchmarks/peers/run_vllm_offline.py" \
    --model "$peers/models/SmolLM2-135M-Instruct-fp32-hf" --workload "$workload" \
    --num-prompts 64 --output-json "$out/w1_vllm_$1.json" > "$out/w1_vllm_$1.log" 2>&1
  echo "vllm $1: $(rate "$out/w1_vllm_$1.json")"
}
pd() {  # pd NAME ARGS...
  local name=$1; shift
  (cd "$out" && "$py" "$@" --output-json "$out/$name.json" > "$out/$name.log" 2>&1)
  echo "$name: $(rate "$out/$name.json")"
}
rates() {  # rates TAG: the peak loops and the matmul rates
  "$py" "$root/benchmarks/arithmetic_peak.py" --json "$out/peak_$1.json" | tee "$out/peak_$1.txt"
  "$py" "$root/benchmarks/ceiling.py" | tee "$out/ceiling_$1.txt"
  for digits in 2 1; do
    "$py" "$root/benchmarks/gguf_matmul.py" --rows 1,64,256,2048 --digits $digits \
      | tee "$out/gguf_matmul_${digits}digit_$1.txt"
  done
}
echo "== $(date +%T) rates"; rates start
echo "== $(date +%T) W1"
vllm r0
for r in $(seq 1 "$rounds"); do
  pd "w1_fp32_r$r" "${w1[@]}"
  pd "w1_gguf_kv16_r$r" "${w1[@]}" --quantization gguf --kv-cache-dtype float16
done
vllm r1
echo "== $(date +%T) rates"; rates end
echo "== $(date +%T) done"
