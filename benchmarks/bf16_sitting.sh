#!/usr/bin/env bash
# bf16 against fp32, pagedllm beside vLLM CPU, in one sitting (benchmarks/results/bf16.md):
#
#   rates   the cores' fp32 FMA and bf16 dot-product peaks (benchmarks.arithmetic_peak),
#           bf16 layers on their bf16 packed weight vs an fp32 copy (benchmarks.bf16_matmul),
#           and with AMX the tile kernel (without it, AVX512-BF16's dot-product kernel)
#           against oneDNN (benchmarks.amx_linear)
#   w1lite  W1-lite (32 random prompts x 256 tokens, 64 out, EOS ignored) on the default
#           model's fp32 weights at --dtype bfloat16 and float32, each engine in its own
#           process, ROUNDS rounds alternating
#   w1      W1 (64 x 256, 128 out) the same way, one round
#   1b      Llama-3.2-1B's shape with random weights (load_format=dummy, a directory with
#           only config.json): one stream (a 1-token prompt, 64 out) and 32 sequences x
#           (128 in, 64 out), both engines, both dtypes
#
# vLLM comes from benchmarks.compare's peer cache (`.venv/bin/python -m benchmarks.compare
# --install-only --only vllm`, ~5 minutes). Every figure lands in OUT_DIR as JSON beside its
# log, with the CPU's flags (cpu_flags.txt). From anywhere:
#
#     benchmarks/bf16_sitting.sh OUT_DIR [ROUNDS]            # ~30 minutes at 2 rounds
#     SECTIONS="w1lite" benchmarks/bf16_sitting.sh OUT_DIR   # sections: rates w1lite w1 1b
#     ENGINES=pagedllm benchmarks/bf16_sitting.sh OUT_DIR    # without vLLM
set -uo pipefail

out=$(mkdir -p "${1:?usage: bf16_sitting.sh OUT_DIR [ROUNDS]}" && cd "$1" && pwd)
rounds=${2:-2}
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
py=$root/.venv/bin/python
peers=${PAGEDLLM_PEERS_DIR:-$HOME/.cache/pagedllm-peers}
engines=${ENGINES:-"vllm pagedllm"}
dtypes=${DTYPES:-"bfloat16 float32"}
want() { [[ " ${SECTIONS:-all} " == *" all "* || " ${SECTIONS:-all} " == *" $1 "* ]]; }
rate() { grep -o '"requests_per_s": [0-9.]*\|"output_tokens_per_s": [0-9.]*' "$1" | tr '\n' ' '; }

grep -m1 '^flags' /proc/cpuinfo > "$out/cpu_flags.txt"
workload() {  # workload NAME PROMPTS INPUT OUTPUT
  [ -f "$out/$1.jsonl" ] || "$py" -c "from pathlib import Path
from benchmarks.peers.workload import Workload, write_workload
write_workload(Workload($2, $3, $4, Path('$out/$1.jsonl')))"
}
vllm_env=$("$py" -c \
  'from benchmarks.peers.vllm_peer import VLLM_ENV; print(" ".join(f"{k}={v}" for k, v in VLLM_ENV.items()))')

run() {  # run ENGINE NAME WORKLOAD PROMPTS MODEL DTYPE [EXTRA...]: one offline run
  local engine=$1 name=$2 wl=$out/$3.jsonl n=$4 model=$5 dtype=$6
  shift 6
  if [ "$engine" = vllm ]; then
    # shellcheck disable=SC2086
    env $vllm_env "$peers/vllm/venv/bin/python" -P "$root/benchmarks/peers/run_vllm_offline.py" \
      --model "$model" --workload "$wl" --num-prompts "$n" --dtype "$dtype" "$@" \
      --output-json "$out/$name.json" > "$out/$name.log" 2>&1
  else
    (cd "$out" && "$py" -m pagedllm bench throughput --model "$model" --dataset-name file \
      --dataset-path "$wl" --num-prompts "$n" --dtype "$dtype" "$@" \
      --output-json "$out/$name.json" > "$out/$name.log" 2>&1)
  fi
  echo "$name: $(rate "$out/$name.json")"
}

if want rates; then
  "$py" -m benchmarks.arithmetic_peak --json "$out/peak.json" | tee "$out/peak.txt"
  "$py" -m benchmarks.bf16_matmul --json "$out/bf16_matmul.json" | tee "$out/bf16_matmul.txt"
  if grep -qw amx_bf16 "$out/cpu_flags.txt"; then
    "$py" -m benchmarks.amx_linear --kernels amx_tiles --json "$out/amx_linear.json" \
      | tee "$out/amx_linear.txt"
  elif grep -qw avx512_bf16 "$out/cpu_flags.txt"; then
    "$py" -m benchmarks.amx_linear --kernels bf16_dots --json "$out/amx_linear.json" \
      | tee "$out/amx_linear.txt"
  fi
fi

if want w1lite; then
  workload w1lite 32 256 64
  model=$peers/models/SmolLM2-135M-Instruct-fp32-hf
  for round in $(seq 1 "$rounds"); do
    for dtype in $dtypes; do
      for engine in $engines; do
        run "$engine" "w1lite_${engine}_${dtype}_$round" w1lite 32 "$model" "$dtype"
      done
    done
  done
fi

if want w1; then
  workload w1 64 256 128
  model=$peers/models/SmolLM2-135M-Instruct-fp32-hf
  for dtype in $dtypes; do
    for engine in $engines; do
      run "$engine" "w1_${engine}_${dtype}" w1 64 "$model" "$dtype"
    done
  done
fi

if want 1b; then
  workload single 1 1 64
  workload batch32 32 128 64
  model=$out/llama-3.2-1b
  "$py" -c "from benchmarks.bf16_matmul import LLAMA_3_2_1B
from pagedllm.model.loader import write_config_dir
write_config_dir('$model', LLAMA_3_2_1B.hf_config())"
  bandwidth=$("$py" -c "from benchmarks.real_size import read_bandwidth_gb_s
print(round(read_bandwidth_gb_s(), 1))")
  echo "read bandwidth: $bandwidth GB/s" | tee "$out/bandwidth.txt"
  dummy=(--load-format dummy --skip-tokenizer-init --max-model-len 1024)
  for dtype in $dtypes; do
    for engine in $engines; do
      run "$engine" "1b_single_${engine}_${dtype}" single 1 "$model" "$dtype" "${dummy[@]}"
      run "$engine" "1b_batch32_${engine}_${dtype}" batch32 32 "$model" "$dtype" "${dummy[@]}"
    done
  done
fi
