source tools/gpu/device_env.sh
D="1:4096:q8_0,1:16384:q8_0,1:65536:q8_0,1:262144:q8_0"
V="23:16384:q8_0,23:65536:q8_0,23:262144:q8_0"
nvidia-smi --query-gpu=name --format=csv,noheader
echo "== attention tests (s36)"
timeout 170 python3 -m pytest -q -p no:cacheprovider -m gpu -rf tests/kernels/test_attention_decode.py tests/kernels/test_attention_verify.py > $OUT/call1-attention-tests.log 2>&1; echo "rc $?"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/call1-attention-tests.log | tail -12
echo "== decode: Triton (new default) vs CUDA (q normed before)"
timeout 80 python3 benchmarks/sweep_tree_attention.py --out $OUT/decode_q8.json --compare --budget-s 45 --cuda-decode-from 0 --cases $D --candidates "new default,q normed before" > $OUT/call1-decode-q8.log 2>&1; tail -6 $OUT/call1-decode-q8.log
echo "== verify: Triton (new default) vs CUDA (q normed before)"
timeout 80 python3 benchmarks/sweep_tree_attention.py --out $OUT/verify_q8.json --compare --budget-s 45 --cuda-verify-from 0 --float32-query --cases $V --candidates "new default,q normed before" > $OUT/call1-verify-q8.log 2>&1; tail -5 $OUT/call1-verify-q8.log
LIMIT_1K=85 LIMIT_64K=100 PARTS="steps-1k-short steps-64k-q8" bash tools/gpu/device_figures.sh
