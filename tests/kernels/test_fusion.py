"""The small fused kernels of the decode step (q/k norm + RoPE, with the K/V cache write, the attention output gate,
SiLU-and-multiply, residual add + RMSNorm; the DeltaNet gates run inside the input stage, test_deltanet_conv.py): each Triton kernel against its torch reference under the CPU
interpreter (in a subprocess), and the references against the unfused model code they replace."""

import pytest
import torch
import torch.nn.functional as F

from flashtree.kernels.activations import gated_heads, glu_halves, interleaved_silu_mul, silu_mul
from flashtree.kernels.deltanet_conv import conv_qkv, conv_qkv_reference
from flashtree.kernels.deltanet_gates import GateInputs, gates_reference
from flashtree.kernels.qk_norm_rope import apply_rope, norm_rope_into_cache, qk_norm_rope
from flashtree.kernels.rms_norm import add_rms_norm, rms_norm_reference
from flashtree.kernels.qk_norm_rope import rope_tables
from tests.kernels import fusion_cases as cases
from tests.kernels.interpreter import run_cases


@pytest.fixture(scope="module")
def interpreter_errors():
    return run_cases("tests.kernels.fusion_cases")


@pytest.mark.parametrize("case", cases.case_ids())
def test_triton_kernel_matches_reference(interpreter_errors, case):
    # float32: the last bits of exp/rsqrt and summation order; bfloat16: plus one flipped final rounding
    assert interpreter_errors[case] <= (1e-6 if case.endswith("float32") else 2e-2)


def test_references_are_the_unfused_model_code():
    """On the CPU the fused entry points run their references, which compute what the model computed
    before the fusion, op for op."""
    gen = torch.Generator().manual_seed(0)
    b, a = torch.randn(2, 6, generator=gen), torch.randn(2, 6, generator=gen) * 10
    decay, bias = -torch.rand(6, generator=gen), torch.randn(6, generator=gen)
    g, beta = gates_reference(b, a, decay, bias)
    assert torch.equal(beta, torch.sigmoid(b)) and torch.equal(g, decay * F.softplus(a + bias))

    x, w = torch.randn(3, 2, 64, generator=gen, dtype=torch.float32).bfloat16(), torch.rand(64, generator=gen)
    cos, sin = rope_tables(torch.tensor([3, 4, 5]), 32, 1e6)
    assert torch.equal(qk_norm_rope(x, w, 1e-6, cos, sin), apply_rope(rms_norm_reference(x, w, 1e-6), cos, sin))

    out, gate = torch.randn(2, 3, 8, generator=gen).bfloat16(), torch.randn(3, 16, generator=gen).bfloat16()
    assert torch.equal(gated_heads(out, gate.view(3, 2, 8)),
                       out.transpose(0, 1).reshape(3, 16) * torch.sigmoid(gate.float()).bfloat16())

    up, gate = torch.randn(3, 16, generator=gen).bfloat16(), torch.randn(3, 16, generator=gen).bfloat16()
    assert torch.equal(silu_mul(gate, up), F.silu(gate) * up)
    # a fused gate + up matmul's outputs, 8 of each in turn: the halves and the product of the interleaved rows
    rows = torch.cat([gate.reshape(3, 2, 8), up.reshape(3, 2, 8)], dim=-1).reshape(3, 32)
    assert all(torch.equal(a, b) for a, b in zip(glu_halves(rows), (gate, up)))
    assert torch.equal(interleaved_silu_mul(rows), F.silu(gate) * up)

    h, delta = torch.randn(3, 32, generator=gen).bfloat16(), torch.randn(3, 32, generator=gen).bfloat16()
    total, normed = add_rms_norm(h, delta, torch.ones(32), 1e-6)
    assert torch.equal(total, h + delta) and torch.equal(normed, rms_norm_reference(h + delta, torch.ones(32), 1e-6))


def test_rope_keeps_the_dims_past_rot_dim():
    x = torch.randn(2, 1, 8)
    cos, sin = rope_tables(torch.tensor([1, 2]), 4, 1e4)
    assert torch.equal(apply_rope(x, cos, sin)[..., 4:], x[..., 4:])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_kernels_at_the_27b_shapes_on_gpu():
    """Each kernel on CUDA against its reference on the same GPU, bf16 at the 27B shapes: within one
    rounding of the output (the conv state's shift is a copy, so exact)."""
    dev, bf16 = "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, device=dev) * scale

    def close(got, want, bound=2e-2):
        got, want = (got,) if isinstance(got, torch.Tensor) else got, (want,) if isinstance(want, torch.Tensor) else want
        for g, w in zip(got, want):
            assert ((g.float() - w.float()).abs().max() / w.float().abs().max()).item() <= bound

    ba = rand(1, 96, scale=6).to(bf16)
    decay, bias = -torch.rand(48, generator=gen, device=dev), rand(48)
    gate_inputs = GateInputs(ba[:, :48], ba[:, 48:], decay, bias)
    qg = rand(23, 24, 2, 256, scale=3).to(bf16)
    w = 1 + 0.1 * rand(256)
    cos, sin = rope_tables(torch.arange(1000, 1023, device=dev), 64, 1e7)
    close(qk_norm_rope(qg[:, :, 0], w, 1e-6, cos, sin),
          apply_rope(rms_norm_reference(qg[:, :, 0], w, 1e-6), cos, sin))
    kv, slots = rand(23, 2, 4, 256, scale=3).to(bf16), torch.randperm(64, device=dev)[:23]  # 4 KV heads of 256
    caches, want = ([torch.zeros(4, 64, 256, dtype=bf16, device=dev) for _ in range(2)] for _ in range(2))
    norm_rope_into_cache(kv[:, 0], kv[:, 1], w, 1e-6, cos, sin, caches[0], caches[1], slots)
    want[0].index_copy_(1, slots, apply_rope(rms_norm_reference(kv[:, 0], w, 1e-6), cos, sin).transpose(0, 1))
    want[1].index_copy_(1, slots, kv[:, 1].transpose(0, 1))
    close(tuple(c[:, slots] for c in caches), tuple(c[:, slots] for c in want))
    out = rand(24, 23, 256).to(bf16)
    close(gated_heads(out, qg[:, :, 1]),
          out.transpose(0, 1).reshape(23, -1) * torch.sigmoid(qg[:, :, 1].float()).reshape(23, -1).to(bf16))
    gate_up = rand(23, 2 * 17408, scale=3).to(bf16)
    close(silu_mul(gate_up[:, :17408], gate_up[:, 17408:]), F.silu(gate_up[:, :17408]) * gate_up[:, 17408:])
    h, delta, w = rand(23, 5120, scale=4).to(bf16), rand(23, 5120).to(bf16), 1 + 0.1 * rand(5120)
    close(add_rms_norm(h, delta, w, 1e-6), (h + delta, rms_norm_reference(h + delta, w, 1e-6)))
    conv_dim = (2 * 16 + 48) * 128
    weight, inputs, state = rand(conv_dim, 4, scale=0.5), rand(1, conv_dim).to(bf16), rand(3, conv_dim)
    states = [state.clone(), state.clone()]
    *qkv, g, beta = conv_qkv(inputs, None, states[0], weight, 16, 48, 128, gate_inputs, advance_state=True)
    close(qkv, conv_qkv_reference(inputs, None, states[1], weight, 16, 48, 128, advance_state=True))
    close((g, beta), gates_reference(*gate_inputs), 1e-5)
    assert torch.equal(states[0], states[1])
