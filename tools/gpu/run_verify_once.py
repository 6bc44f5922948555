#!/usr/bin/env python3
"""One model-shaped verify call over TQ3_0 rows (the 27B's 24 / 4 heads, head dim 256, a float32 query normed and
rotated before, bf16 operands), twice: the second launch for a profiler (tools/gpu/ncu_mma.sh NCU_KERNEL=...).
    python3 tools/gpu/run_verify_once.py [ROWS [TOKENS]]"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
from flashtree.kernels.tree_attention import tree_attention  # noqa: E402
from tests.kernels.test_attention_verify import _inputs  # noqa: E402

rows = int(sys.argv[1]) if len(sys.argv) > 1 else 65536
tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 23
args = _inputs(rows, tokens, torch.float32, token_major=True)
for _ in range(2):
    tree_attention(**args, operands=torch.bfloat16)
torch.cuda.synchronize()
print("done", rows, tokens)
