"""The Gated DeltaNet's per-head gates from its two small projections:

    beta = sigmoid(b)                            (the delta rule's write strength)
    g    = decay_rate * softplus(a + dt_bias)    (the log of the state's decay; decay_rate = -exp(A_log) < 0)

both float32 [T, H]. PyTorch spends six kernels on these (two casts, sigmoid, add, softplus, product): at
48 DeltaNet layers ~290 launches per decode or verify step for a few hundred numbers. On the GPU they are
computed inside the DeltaNet input stage's launch (`deltanet_conv.conv_qkv`, with `gate_values` below).
Both forms compute in float32; they differ in the last bits of exp and log.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

try:  # the kernel needs triton; the reference does not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency where kernels run
    triton = None


class GateInputs(NamedTuple):
    """What the gates are computed from: b, a [T, H] (the projections' rows, any float dtype, rows may be
    strided), decay_rate and dt_bias float32 [H] (the layer's constants)."""

    b: torch.Tensor
    a: torch.Tensor
    decay_rate: torch.Tensor
    dt_bias: torch.Tensor


def gates_reference(b: torch.Tensor, a: torch.Tensor, decay_rate: torch.Tensor,
                    dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """b, a [T, H] (any float dtype, rows may be strided), decay_rate and dt_bias float32 [H] -> (g, beta)."""
    beta = torch.sigmoid(b.float())
    g = decay_rate * F.softplus(a.float() + dt_bias)
    return g, beta


if triton is not None:

    @triton.jit
    def gate_values(b, a, decay, bias):
        """(g, beta) of float32 b, a, decay_rate and dt_bias values (any matching shapes)."""
        x = a + bias
        # softplus: x past torch's threshold (20), exp(x) where 1 + exp(x) would round to 1, else log(1 + exp(x))
        softplus = tl.where(x > 20.0, x, tl.where(x < -15.0, tl.exp(x), tl.log(1.0 + tl.exp(x))))
        return decay * softplus, tl.sigmoid(b)
