#!/usr/bin/env bash
# One device call (carry .whl): long-context figures at the 27B shape. AR/verify steps after 1K and 64K
# committed tokens (same run order, same process settings), 128K prefill, and peak memory at 256K with
# TQ3_0 K/V. Results under $OUT.
source tools/gpu/device_env.sh
run() {  # name, seconds, bench flags...
  name=$1; limit=$2; shift 2
  timeout "$limit" python3 -m flashtree.cli.main bench --synthetic qwen3.6-27b --echo --scheme q4_k_m --device cuda --steps \
      -n 32 --repeat 10 --out "$OUT/$name.json" "$@" 2>&1 | tee "$OUT/$name.txt" | tail -14
}
run ctx1k 150 --context 1024 --prefill-lengths 1024
run ctx64k 200 --context 65536 --prefill-lengths 131072
run ctx256k-tq3 240 --context 262000 --prefill-lengths 1024 -ctk tq3_0 -ctv tq3_0
