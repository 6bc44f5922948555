#!/usr/bin/env bash
# One device call: CUDA tests, then continue training the demo draft on more target-written data.
source tools/gpu/device_env.sh
python3 -m pytest -q -p no:cacheprovider tests/engine/test_cuda.py 2>&1 | tee "$OUT/pytest.txt" | tail -6
python3 -m flashtree.train.cli draft --target src/flashtree/assets/demo-target.gguf \
    --init src/flashtree/assets/demo-draft --out "$OUT/draft" --device cuda --time-budget "${BUDGET:-270}" \
    --prompts 24000 --max-chars 60000000 --gen-batch-size 512 --features hf --lr 6e-4 --steps 100000 \
    2>&1 | tee "$OUT/draft-train.log" | grep -v "^draft step" | tail -12
