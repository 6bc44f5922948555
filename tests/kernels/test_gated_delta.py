"""The three exact forms of the gated delta rule agree: token loop, chunked, ancestor-masked tree."""

import pytest
import torch

from flashtree.kernels import gated_delta


def inputs(t, h=3, dk=8, dv=6, seed=0, strong_decay=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, dk, generator=g)
    k = torch.nn.functional.normalize(torch.randn(t, h, dk, generator=g), dim=-1)
    v = torch.randn(t, h, dv, generator=g)
    decay = -torch.rand(t, h, generator=g) * (20.0 if strong_decay else 1.0)
    beta = torch.rand(t, h, generator=g)
    return q, k, v, decay, beta, torch.randn(h, dk, dv, generator=g)


def test_chunked_equals_recurrent_across_chunk_boundaries():
    for strong in (False, True):
        args = inputs(150, strong_decay=strong)
        o1, s1 = gated_delta.recurrent(*args)
        o2, s2 = gated_delta.chunked(*args, chunk_size=64)
        assert torch.allclose(o1, o2, atol=5e-5, rtol=1e-5) and torch.allclose(s1, s2, atol=1e-5)


def test_tree_outputs_equal_each_root_to_leaf_path_run_as_a_sequence():
    parents = [-1, 0, 0, 1, 1, 3, 2, 6, 6, 4]
    n = len(parents)
    anc = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            anc[i, j] = True
            j = parents[j]
    q, k, v, g, beta, state = inputs(n, seed=3)
    out, u, gamma = gated_delta.ancestor_chunk(q, k, v, g, beta, state, anc)
    for leaf in range(n):
        path = [j for j in range(n) if anc[leaf, j]]
        seq_out, seq_state = gated_delta.recurrent(q[path], k[path], v[path], g[path], beta[path], state)
        assert torch.allclose(out[leaf], seq_out[-1], atol=1e-5)
        folded = gated_delta.fold(state, k, u, gamma, torch.tensor(path))
        assert torch.allclose(folded, seq_state, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fla_chunked_prefill_matches_the_reference():
    from flashtree.kernels import gated_delta_fla

    if not gated_delta_fla.available():
        pytest.skip("fla-core not installed")
    torch.manual_seed(0)
    t, h, d = 700, 48, 128
    q = torch.nn.functional.normalize(torch.randn(t, h, d, device="cuda"), dim=-1) * d**-0.5
    k = torch.nn.functional.normalize(torch.randn(t, h, d, device="cuda"), dim=-1)
    v, beta = torch.randn(t, h, d, device="cuda"), torch.rand(t, h, device="cuda")
    g = -torch.rand(t, h, device="cuda") * 0.3
    state = torch.randn(h, d, d, device="cuda") * 0.1
    want_o, want_s = gated_delta.chunked(q, k, v, g, beta, state)
    got_o, got_s = gated_delta_fla.chunked(q, k, v, g, beta, state)
    assert (got_o - want_o).abs().max() < 2e-2 * want_o.abs().max()  # fla's dots may run in tf32
    assert (got_s - want_s).abs().max() < 2e-2 * want_s.abs().max()
