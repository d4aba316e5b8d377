#!/usr/bin/env bash
# Before/after a change, in one sitting: W1 offline throughput (64 prompts x 256 tokens in,
# 128 out, fp32) and single-stream decode (a 1-token prompt, 128 tokens out), each in
# PAIRS alternating pairs of processes (before first in odd pairs, after first in even ones),
# so the machine's minute-to-minute drift falls on both sides alike. BEFORE_TREE is a
# checkout of the earlier commit (`git worktree add /tmp/before <commit>`); its `pagedllm`
# package runs on this tree's virtualenv. Prints each pair and the medians; the figures land
# in OUT_DIR as JSON, with the CPU's flags (cpu_flags.txt).
#
#     benchmarks/ab_pairs.sh BEFORE_TREE OUT_DIR [PAIRS]     # about 2 minutes a pair
set -euo pipefail

before=$(cd "${1:?usage: ab_pairs.sh BEFORE_TREE OUT_DIR [PAIRS]}" && pwd)
out=$(mkdir -p "${2:?usage: ab_pairs.sh BEFORE_TREE OUT_DIR [PAIRS]}" && cd "$2" && pwd)
pairs=${3:-5}
after=$(cd "$(dirname "$0")/.." && pwd)
py=$after/.venv/bin/python

grep -m1 '^flags' /proc/cpuinfo > "$out/cpu_flags.txt"
workload=$out/workload_64.jsonl
[ -f "$workload" ] || (cd "$after" && "$py" -c "from pathlib import Path
from benchmarks.peers.workload import Workload, write_workload
write_workload(Workload(64, 256, 128, Path('$workload')))")

run() {  # run SIDE PAIR KIND: one process; `python -m pagedllm` imports the side's package
  local tree=$before
  [ "$1" = after ] && tree=$after
  local args=(throughput --dataset-name file --dataset-path "$workload" --num-prompts 64)
  [ "$3" = decode ] && args=(latency --batch-size 1 --input-len 1 --output-len 128
    --num-iters 5 --num-iters-warmup 1)
  (cd "$tree" && "$py" -m pagedllm bench "${args[@]}" --dtype float32 \
    --output-json "$out/$3_$1_$2.json" > "$out/$3_$1_$2.log" 2>&1)
}

for pair in $(seq 1 "$pairs"); do
  order="before after"
  [ $((pair % 2)) -eq 0 ] && order="after before"
  for kind in w1 decode; do
    for side in $order; do run "$side" "$pair" "$kind"; done
  done
  echo "pair $pair done ($order)"
done

"$py" - "$out" "$pairs" <<'PY'
import json
import statistics
import sys
from pathlib import Path

out, pairs = Path(sys.argv[1]), int(sys.argv[2])


def figure(kind, side, pair):
    data = json.loads((out / f"{kind}_{side}_{pair}.json").read_text())
    if kind == "w1":
        return data["requests_per_s"]
    return 1000 / data["per_output_token_ms"]["50"]  # median request, tokens/s


for kind, unit in (("w1", "req/s"), ("decode", "tok/s")):
    rows = [(figure(kind, "before", p), figure(kind, "after", p)) for p in range(1, pairs + 1)]
    for pair, (b, a) in enumerate(rows, 1):
        print(f"{kind} pair {pair}: before {b:.3f} after {a:.3f} {unit}  after/before {a / b:.3f}")
    print(
        f"{kind} median: before {statistics.median(b for b, _ in rows):.3f} "
        f"after {statistics.median(a for _, a in rows):.3f} {unit}; "
        f"median after/before {statistics.median(a / b for b, a in rows):.3f}"
    )
PY
