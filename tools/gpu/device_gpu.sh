#!/usr/bin/env bash
# One device call (carry .whl, made by scripts/fetch_device_wheels.sh): the GPU tests of every kernel and of the
# graphed engine, the quant_matmul sweep, then `bench --steps` at the Qwen3.6-27B shape.
# Each part has its own time limit so that a hang costs one part, not the call. Results under $OUT.
source tools/gpu/device_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
if [ "${TESTS:-1}" = 1 ]; then
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider -m gpu ${TEST_FILES:-tests/engine/test_cuda.py \
      tests/engine/test_cuda_graphs.py tests/kernels/test_gated_delta_triton.py tests/kernels/test_tree_attention.py \
      tests/kernels/test_quant_matmul.py tests/kernels/test_gated_delta.py} 2>&1 | tee "$OUT/pytest.txt" | tail -25
fi
if [ "${SWEEP:-1}" = 1 ]; then
  timeout "${SWEEP_TIMEOUT:-300}" python3 benchmarks/sweep_quant_matmul.py --out "$OUT/sweep.json" 2>&1 | tee "$OUT/sweep.txt" | tail -30
fi
timeout "${BENCH_TIMEOUT:-300}" python3 -m flashtree.cli.main bench --synthetic "${SHAPE:-qwen3.6-27b}" --echo --scheme q4_k_m \
    --device cuda --steps -n "${NGEN:-128}" --out "$OUT/steps.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/steps.txt" | tail -30
if [ "${MULTI_TURN:-0}" = 1 ]; then  # prefix cache at the 27B shape: TTFT per turn, cache off vs on
  timeout "${MULTI_TURN_TIMEOUT:-240}" python3 -m flashtree.cli.main bench --synthetic qwen3.6-27b --echo --scheme q4_k_m \
      --device cuda --multi-turn --out "$OUT/multi-turn.json" 2>&1 | tee "$OUT/multi-turn.txt" | tail -20
fi
if [ "${PEERS:-1}" = 1 ]; then  # the demo pair against our AR, transformers and the z-lab loop; a 0.8B-shape peer
  timeout 200 python3 -m flashtree.cli.main bench --device cuda --dataset humaneval --prompts 10 -n 128 --peers \
      --out "$OUT/demo-peers.json" 2>&1 | tee "$OUT/demo-peers.txt" | tail -8
  timeout 200 python3 -m flashtree.cli.main bench --synthetic qwen3.5-0.8b --scheme q4_k_m --device cuda --prompts 4 \
      -n 64 --peers --out "$OUT/peers-0.8b.json" 2>&1 | tee "$OUT/peers-0.8b.txt" | tail -6
fi
