"""The Gated DeltaNet's per-head gates from its two small projections, in one launch:

    beta = sigmoid(b)                            (the delta rule's write strength)
    g    = decay_rate * softplus(a + dt_bias)    (the log of the state's decay; decay_rate = -exp(A_log) < 0)

both float32 [T, H]. PyTorch spends six kernels on these (two casts, sigmoid, add, softplus, product): at
48 DeltaNet layers ~290 launches per decode or verify step for a few hundred numbers. The Triton kernel
is one program per token. Both forms compute in float32; they differ in the last bits of exp and log.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashtree.kernels import triton_runs_on

try:  # the kernel needs triton; the reference does not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency where kernels run
    triton = None

def gates_reference(b: torch.Tensor, a: torch.Tensor, decay_rate: torch.Tensor,
                    dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """b, a [T, H] (any float dtype, rows may be strided), decay_rate and dt_bias float32 [H] -> (g, beta)."""
    beta = torch.sigmoid(b.float())
    g = decay_rate * F.softplus(a.float() + dt_bias)
    return g, beta


def gates(b: torch.Tensor, a: torch.Tensor, decay_rate: torch.Tensor,
          dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`gates_reference` in one launch where Triton runs."""
    t, h = b.shape
    if (triton is None or not triton_runs_on(b.device) or t == 0 or b.stride(-1) != 1 or a.stride(-1) != 1
            or a.shape != b.shape):
        return gates_reference(b, a, decay_rate, dt_bias)
    g = torch.empty(t, h, dtype=torch.float32, device=b.device)
    beta = torch.empty_like(g)
    _gates_kernel[(t,)](b, a, decay_rate, dt_bias, g, beta, b.stride(0), a.stride(0), h,
                        BLOCK=triton.next_power_of_2(h), num_warps=1)
    return g, beta


if triton is not None:

    @triton.jit
    def _gates_kernel(b_ptr, a_ptr, decay_ptr, bias_ptr, g_ptr, beta_ptr, b_stride, a_stride, H,
                      BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < H
        b = tl.load(b_ptr + row * b_stride + cols, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(a_ptr + row * a_stride + cols, mask=mask, other=0.0).to(tl.float32)
        x += tl.load(bias_ptr + cols, mask=mask, other=0.0)
        # softplus: x past torch's threshold (20), exp(x) where 1 + exp(x) would round to 1, else log(1 + exp(x))
        softplus = tl.where(x > 20.0, x, tl.where(x < -15.0, tl.exp(x), tl.log(1.0 + tl.exp(x))))
        g = tl.load(decay_ptr + cols, mask=mask, other=0.0) * softplus
        tl.store(g_ptr + row * H + cols, g, mask=mask)
        tl.store(beta_ptr + row * H + cols, tl.sigmoid(b), mask=mask)
