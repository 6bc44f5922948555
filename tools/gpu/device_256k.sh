#!/usr/bin/env bash
# One device call (carry .whl): the 256K-context memory figure. The 27B shape with 262,000 tokens of context in a TQ3_0
# K/V cache, budget 22, bf16 draft: context prefill time, steps at that context, peak GPU memory.
source tools/gpu/device_env.sh
timeout "${LIMIT:-270}" python3 -m flashtree.cli.main bench --synthetic qwen3.6-27b --echo --scheme q4_k_m --device cuda \
    --steps -n 8 --repeat 3 --replay-al 0 --context 262000 --prefill-chunk 2048 --prefill-lengths 1024 \
    -ctk tq3_0 -ctv tq3_0 --out "$OUT/steps-256k-tq3.json" 2>&1 | tee "$OUT/steps-256k-tq3.txt"
