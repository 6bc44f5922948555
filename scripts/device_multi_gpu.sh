#!/usr/bin/env bash
# One call on nvidia-h200-x2 (carry .whl, made by scripts/fetch_device_wheels.sh): placement tests, then
# the synthetic 27B step benchmark on one GPU and per placement, with memory per GPU. Results under $OUT.
source scripts/device_env.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/dist 2>&1 | tee "$OUT/pytest.txt" | tail -15
for placement in "one:" "split:--layer-split 1,1" "draft1:--draft-device cuda:1"; do
  name=${placement%%:*}; flags=${placement#*:}
  timeout 240 python3 -m flashtree.cli.main bench --synthetic qwen3.6-27b --echo --scheme q4_k_m --device cuda --steps \
      -n 64 --repeat 10 $flags --out "$OUT/steps-$name.json" 2>&1 | tee "$OUT/steps-$name.txt" | tail -16
done
