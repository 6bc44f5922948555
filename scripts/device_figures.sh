#!/usr/bin/env bash
# One device call (carry .whl) for the figures of #6, #7 and #9 at the Qwen3.6-27B shape, each part with
# its own limit: steps at 1K context (+ 1K/13K prefill, replay), prefix-cache TTFT per turn, steps at 64K
# context (+ 128K prefill), peak memory with 262K context in TQ3_0. Results under $OUT; last, one table.
source scripts/device_env.sh
bench() {  # name, seconds, bench flags...
  name=$1; limit=$2; shift 2
  timeout "$limit" python3 -m flashtree.cli.main bench --synthetic qwen3.6-27b --echo --scheme q4_k_m --device cuda \
      --out "$OUT/$name.json" "$@" > "$OUT/$name.txt" 2>&1
  echo "== $name (rc $?)"; tail -${TAIL:-16} "$OUT/$name.txt"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
bench steps-1k 200 --steps -n 128 --repeat 10 --context 1024 --prefill-chunk 2048 --prefill-lengths 1024,13000
TAIL=12 bench multi-turn 110 --multi-turn -n 32
bench steps-64k 170 --steps -n 32 --repeat 10 --context 65536 --prefill-chunk 2048 --prefill-lengths 131072
TAIL=4 bench steps-256k-tq3 110 --steps -n 16 --repeat 5 --context 262000 --prefill-chunk 2048 \
    --prefill-lengths 1024 -ctk tq3_0 -ctv tq3_0
