#!/usr/bin/env bash
# One device call for the tensor-core Q4_K/Q6_K kernels (carry .whl, made by scripts/fetch_device_wheels.sh):
# cold compile of every instance, a smoke check, their GPU tests, the launch-configuration sweep, then the
# 27B-shape steps. Each part has its own time limit. Results under $OUT.
source tools/gpu/device_env.sh
export FLASHTREE_CACHE=/tmp/ftcache
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, cuda.bindings; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda-bindings', cuda.bindings.__version__)" | tee -a "$OUT/gpu.txt"
python3 -c "import time, torch; from flashtree.kernels.quant_matmul import mma; t = time.time(); \
mma.precompile(mma.instances(), mma.arch_of(torch.device('cuda'))); \
print(f'cold compile of {len(mma.instances())} instances, 16 processes: {time.time() - t:.1f} s')" 2>&1 | tee "$OUT/compile.txt"
[ "${SMOKE:-1}" = 1 ] && python3 - <<'PY' 2>&1 | tee "$OUT/smoke.txt"
import torch
from flashtree.kernels.quant_matmul import quant_matmul, quant_matmul_reference, random_quant_weight
from gguf import GGMLQuantizationType as Q
for qt in (Q.Q4_K, Q.Q6_K):
    w = random_quant_weight(qt, 17408, 5120, "cuda")
    for m in (1, 23, 32, 100):
        x = torch.randn(m, 5120, dtype=torch.bfloat16, device="cuda")
        y, ref = quant_matmul(x, w).float(), quant_matmul_reference(x.float(), w).float()
        print(qt.name, m, "max rel err", ((y - ref).abs().max() / ref.abs().max()).item(), flush=True)
PY
if [ "${TESTS:-1}" = 1 ]; then
  timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider -m gpu --timeout 60 -rf --tb=line \
      ${TEST_FILES:-tests/kernels/test_mma.py tests/kernels/test_quant_matmul.py} 2>&1 | tee "$OUT/pytest.txt" \
      | grep -E "passed|failed|FAILED|^E |Error" | tail -15
fi
if [ "${STEPS:-1}" = 1 ]; then
  timeout "${STEPS_TIMEOUT:-200}" python3 -m flashtree.cli.main bench --synthetic qwen3.6-27b --echo --scheme q4_k_m \
      --device cuda --steps -n 32 --repeat 5 --replay-al 0 --prefill-lengths 1024 --out "$OUT/steps.json" \
      ${STEPS_ARGS:-} 2>&1 | tee "$OUT/steps.txt" | tail -25
fi
if [ "${SWEEP:-1}" = 1 ]; then
  timeout "${SWEEP_TIMEOUT:-150}" python3 benchmarks/sweep_mma.py --out "$OUT/sweep_mma.json" --budget-s "${SWEEP_BUDGET:-110}" \
      2>&1 | tee "$OUT/sweep_mma.txt" | tail -45
fi
if [ "${KERNELS:-0}" = 1 ]; then
  timeout "${KERNELS_TIMEOUT:-300}" python3 -m flashtree.cli.main bench --kernels --out "$OUT/kernels.json" 2>&1 \
      | tee "$OUT/kernels.txt" | tail -80
fi
