#!/usr/bin/env bash
# One call on nvidia-h200-x2 (carry .whl, made by scripts/fetch_device_wheels.sh, ~500 s): placement tests,
# the synthetic 27B step benchmark on one GPU and per placement (layer split, draft
# on cuda:1, tensor parallel 2) with memory per GPU and,
# with LONG_256K=1, meanwhile on GPU 1, the 262K-token TQ3_0 memory run. Results under $OUT.
source tools/gpu/device_env.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
steps() {  # name, seconds, extra flags
  name=$1; limit=$2; shift 2
  timeout "$limit" python3 -m flashtree.cli.main bench --synthetic qwen3.6-27b "$@" --scheme q4_k_m --device cuda \
      --steps -n 32 --repeat 5 --replay-al 0 --out "$OUT/steps-$name.json" > "$OUT/steps-$name.txt" 2>&1
  echo "== $name (rc $?)"; tail -${TAIL:-16} "$OUT/steps-$name.txt"
}
if [ "${LONG_256K:-0}" = 1 ]; then  # plain (untied) random model: a real file's layout and bytes
  CUDA_VISIBLE_DEVICES=1 TAIL=20 steps 256k-tq3 "${LIMIT_256K:-300}" --context 262000 --prefill-chunk 512 \
      --prefill-lengths 1024 -ctk tq3_0 -ctv tq3_0 > "$OUT/long.log" 2>&1 &
fi
timeout "${LIMIT_TESTS:-100}" python3 -m pytest -q -p no:cacheprovider -p no:warnings -m gpu tests/parallel \
    > "$OUT/pytest.txt" 2>&1  # the single-GPU tests run in tools/gpu/device_figures.sh (part tests)
echo "== gpu tests (rc $?)"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest.txt" | tail -15
CUDA_VISIBLE_DEVICES=0 steps one 200 --echo --prefill-lengths 1024
wait
cat "$OUT/long.log" 2>/dev/null
steps split 150 --echo --prefill-lengths 1024 --layer-split 1,1
steps draft1 150 --echo --prefill-lengths 1024 --draft-device cuda:1
# tensor parallel: every rank builds its quantized shard on its GPU and runs the bench in lock step
steps tp2 200 --echo --prefill-lengths 1024 -tp 2
