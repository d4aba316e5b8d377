#!/bin/bash
# Side-by-side extras of RESULTS.md's sixth run, after `benchmarks/cpu_perf.sh OUT_DIR fa2679a`
# (its before-src worktree and W1 workload): before = that worktree, after = this checkout.
#     benchmarks/results/keys-in-lanes-2026-11-25/extra.sh OUT_DIR
set -u
out=$(cd "${1:?usage: extra.sh OUT_DIR}" && pwd)
root=$(cd "$(dirname "$0")/../../.." && pwd)
py=$root/.venv/bin/python
after() { (cd "$out" && "$@"); }
before() { (cd "$out" && PAGEDLLM_CACHE_DIR=$out/before-cache PYTHONPATH=$out/before-src "$@"); }
w1=(-m pagedllm bench throughput --dataset-name file --dataset-path "$out/w1/workload_64.jsonl" --num-prompts 64 --dtype float32 --quantization gguf)
echo "== $(date +%T) gguf W1"
for side in after before before after; do
  n=$(ls $out/w1_gguf_kv_fp16_${side}_*.json 2>/dev/null | wc -l)
  $side "$py" "${w1[@]}" --kv-cache-dtype float16 --output-json "$out/w1_gguf_kv_fp16_${side}_$n.json" > "$out/w1_gguf_kv_fp16_${side}_$n.log" 2>&1
done
after "$py" "${w1[@]}" --output-json "$out/w1_gguf_after.json" > "$out/w1_gguf_after.log" 2>&1
echo "== $(date +%T) attention A/B"
mkdir -p $out/attention_kernel $out/gguf_matmul
cases="decode 256 x 320,prefill 8 x 256 fresh,prefill 2048 fresh,prefill 2048 after 2048 cached,prefill 256 after 512 cached"
for round in 1 2 3; do
  order="before after"; [ $round = 2 ] && order="after before"
  for side in $order; do
    for dt in float32 float16; do
      $side "$py" "$root/benchmarks/attention_kernel.py" --repeats 10 --kv-cache-dtype $dt --cases "$cases" > $out/attention_kernel/${side}_${dt}_$round.log 2>&1
    done
    $side "$py" "$root/benchmarks/gguf_matmul.py" > $out/gguf_matmul/${side}_$round.log 2>&1
  done
done
echo "== $(date +%T) decode floor"
for dt in float32 float16 float32 float16; do
  after "$py" "$root/benchmarks/decode_attention_floor.py" --kv-cache-dtype $dt >> $out/decode_floor.log 2>&1
done
echo "== $(date +%T) 4096-token prompt"
for side in before after after before; do
  n=$(ls $out/latency_4096_${side}_*.json 2>/dev/null | wc -l)
  $side "$py" -m pagedllm bench latency --input-len 4096 --output-len 1 --batch-size 1 --num-iters 3 --num-iters-warmup 1 --no-enable-prefix-caching --output-json $out/latency_4096_${side}_$n.json > $out/latency_4096_${side}_$n.log 2>&1
done
echo "== $(date +%T) accuracy"
after "$py" "$root/benchmarks/int8_accuracy.py" --variants gguf,gguf/kv-fp16 --output-json $out/int8_accuracy_gguf.json > $out/int8_accuracy_gguf.log 2>&1
echo "== $(date +%T) done"
