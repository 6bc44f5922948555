#!/usr/bin/env bash
# One device call: CUDA tests, then a synthetic benchmark. Carry .whl (gguf wheel); results under $OUT.
source scripts/device_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
python3 -m pytest -q -p no:cacheprovider tests/engine/test_cuda.py tests/formats/test_quants.py tests/spec/test_lossless.py "$@" 2>&1 | tee "$OUT/pytest.txt" | tail -15
python3 -m flashtree.cli.main bench --synthetic qwen3.5-0.8b --scheme q8_0 --device cuda -n 64 --prompts 4 --out "$OUT/bench-0.8b.json" 2>&1 | tee "$OUT/bench.txt"
