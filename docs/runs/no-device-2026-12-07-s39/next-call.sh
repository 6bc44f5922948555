# The next session's first device call, prepared in the thirty-ninth (copy it to tools/gpu/.call1.sh, carry it with
# .whl; ~560 s). block32_mma.cu (Q8_0, Q5_K, IQ4_XS on tensor cores) is on main behind FLASHTREE_BLOCK32=1, never
# run on a GPU (the thirty-ninth session got no machine): its default turns on once these pass and the sweep shows it
# ahead of Triton. The fast subset also runs the memory-snapshot GPU test's fix (7218c16) for the first time.
#  1. block32's GPU tests (every type against the float32 dequantization, row bits independent of M, the public
#     entries); 2. its sweep at the 27B shapes against Triton and cuBLAS (picks rt/warps per row count);
#  3. issue #16's whole table (bench --kernels: Q8_0, Q5_K, IQ4_XS now through block32); 4. the fast GPU subset.
source tools/gpu/device_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 90 python3 -m pytest -q -p no:cacheprovider -p no:warnings -m gpu tests/kernels/test_block32_mma.py > "$OUT/b32_tests.txt" 2>&1
echo "== block32 tests (rc $?)"; grep -E 'passed|failed|Error|assert' "$OUT/b32_tests.txt" | tail -12 | cut -c1-400
timeout 170 python3 benchmarks/sweep_block32.py --budget-s 140 --shapes "gate/up 17408x5120,down 5120x17408,head 248320x5120" \
    --out "$OUT/block32.json" > "$OUT/block32.txt" 2>&1
echo "== block32 sweep (rc $?)"; tail -36 "$OUT/block32.txt" | cut -c1-160
LIMIT_TESTS=230 PARTS=fast-tests bash tools/gpu/device_figures.sh 2>&1 | tail -20
# then, in a second call: FLASHTREE_BLOCK32=1 LIMIT_KERNELS=290 PARTS=kernel-table bash tools/gpu/device_figures.sh,
# and the Q8_0 27B step with FLASHTREE_BLOCK32=1 and =0
# (bench --synthetic qwen3.6-27b --scheme q8_0 --steps -n 32 --repeat 5 --replay-al 0 --context 1024
#  --prefill-lengths none --chunk-lengths none --verify-budgets 22)
