#!/usr/bin/env bash
# More W1 pairs, prefault on first this time (run.sh ran off first): fp32 and gguf + fp16 KV.
#     benchmarks/results/kv-prefault-2026-11-25/w1_more.sh OUT_DIR [ROUNDS]
set -uo pipefail
out=$(mkdir -p "${1:?OUT_DIR}" && cd "$1" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
py=$(cd "$here/../../.." && pwd)/.venv/bin/python
w1=(-m pagedllm bench throughput --dataset-name file --dataset-path "$here/workload_64.jsonl"
  --num-prompts 64 --dtype float32)
for r in $(seq 1 "${2:-3}"); do
  for args in "fp32" "gguf_kv16 --quantization gguf --kv-cache-dtype float16"; do
    set -- $args; name=$1; shift
    for on in 1 0; do
      (cd "$out" && PAGEDLLM_KV_PREFAULT=$on "$py" "${w1[@]}" "$@" \
        --output-json "$out/w1_${name}_prefault${on}_more$r.json" > "$out/w1_${name}_prefault${on}_more$r.log" 2>&1)
      echo "$name prefault=$on more$r: $(grep -o '"requests_per_s": [0-9.]*' "$out/w1_${name}_prefault${on}_more$r.json")"
    done
  done
done
