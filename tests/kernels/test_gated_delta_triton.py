"""Fused gated delta kernels: Triton kernels through the interpreter in one subprocess (TRITON_INTERPRET
must be set before triton is imported); references, fallback and errors in-process; 27B sizes on GPU."""


import pytest
import torch

from flashtree.errors import FlashtreeError
from flashtree.kernels import gated_delta
from flashtree.kernels.gated_delta_triton import (FoldBuffers, FoldTables, ancestors_from_parents, fold_layers,
                                                  fold_path, recurrent_step,
                                                  recurrent_step_reference, tree_verify, tree_verify_reference,
                                                  tree_verify_with_fold)

from tests.kernels import gated_delta_triton_cases as cases
from tests.kernels.interpreter import run_cases

TOLERANCE = 1e-5  # of max |reference|: float32 rounding (observed <= 3e-6, the 64-node chain)
# strong decay over 64 nodes: exp(Gamma) underflows and both WY forms (kernel and ancestor_chunk) sit
# up to ~5e-6 from a float64 token loop, so they may differ by ~1e-5 from each other
STRONG_DECAY_TOLERANCE = 5e-5


@pytest.fixture(scope="module")
def interpreter_results():
    return run_cases("tests.kernels.gated_delta_triton_cases")


@pytest.mark.slow  # the Triton interpreter: seconds per case
@pytest.mark.parametrize("case", cases.case_ids())
def test_triton_kernel_matches_reference(interpreter_results, case):
    result = interpreter_results[case]
    assert result["error"] <= (STRONG_DECAY_TOLERANCE if "strong" in case else TOLERANCE)
    if case.startswith("tree"):
        assert not result["state_changed"]  # bit-identical


def test_ancestors_from_parents():
    anc = ancestors_from_parents(torch.tensor([-1, 0, -1, 1, 2]))
    expected = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [1, 1, 0, 1, 0], [0, 0, 1, 0, 1]])
    assert torch.equal(anc, expected.bool())
    with pytest.raises(FlashtreeError, match=r"parents\[1\] = 1"):
        ancestors_from_parents(torch.tensor([-1, 1]))


def test_tree_reference_equals_each_path_run_in_sequence():
    parents = cases.TREES["random17"]()
    q, k, v, g, beta, state = cases.inputs(len(parents), hk=1, seed=5)
    before = state.clone()
    out = tree_verify_reference(q, k, v, g, beta, state, parents)
    assert torch.equal(state, before)
    anc = ancestors_from_parents(parents)
    for node in range(len(parents)):
        path = anc[node].nonzero().flatten()
        seq_state = state.clone()
        seq = recurrent_step_reference(q[path], k[path], v[path], g[path], beta[path], seq_state)
        assert torch.allclose(out[node], seq[-1], atol=1e-5, rtol=1e-5)


def test_fallback_without_triton_keeps_semantics(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v, g, beta, state = cases.inputs(4)
    expected_o, expected_state = gated_delta.recurrent(q, k, v, g, beta, state)
    buffer = state.clone()
    assert torch.equal(recurrent_step(q, k, v, g, beta, buffer), expected_o)
    assert torch.equal(buffer, expected_state)  # updated in place
    parents = torch.tensor([-1, 0, 0, 1])
    out = tree_verify(q, k, v, g, beta, buffer, parents)
    assert torch.equal(buffer, expected_state)  # untouched
    assert torch.equal(out, tree_verify_reference(q, k, v, g, beta, buffer, parents))


def test_errors_name_the_problem():
    q, k, v, g, beta, state = cases.inputs(3)
    with pytest.raises(FlashtreeError, match="state must be float32"):
        recurrent_step(q, k, v, g, beta, state.double())
    with pytest.raises(FlashtreeError, match="g and beta"):
        recurrent_step(q, k, v, g[:2], beta, state)
    with pytest.raises(FlashtreeError, match="value heads a multiple"):
        recurrent_step(q[:, :2], k[:, :2], v, g, beta, state)
    with pytest.raises(FlashtreeError, match="parents must be int64"):
        tree_verify(q, k, v, g, beta, state, torch.tensor([-1.0, 0.0, 1.0]))
    big = cases.inputs(65)
    with pytest.raises(FlashtreeError, match="at most 64 nodes"):
        tree_verify(*big, torch.arange(-1, 64))


FOLD_SHAPES = ((32, 16, 4), (64, 16, 4), (64, 32, 8), (32, 64, 8), (128, 16, 8), (128, 8, 4))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("t", [1, 23])
def test_real_sizes_on_gpu(t):
    """Qwen3.6-27B linear attention: 48 value heads (16 q/k heads), 128 x 128 float32 state."""
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator(device="cuda").manual_seed(t)
    h, hk, d = 48, 16, 128
    q = torch.randn(t, hk, d, generator=gen, device="cuda") * d**-0.5
    k = torch.nn.functional.normalize(torch.randn(t, hk, d, generator=gen, device="cuda"), dim=-1)
    v = torch.randn(t, h, d, generator=gen, device="cuda")
    g = -torch.rand(t, h, generator=gen, device="cuda")
    beta = torch.rand(t, h, generator=gen, device="cuda")
    state = torch.randn(h, d, d, generator=gen, device="cuda")

    def rel(x, ref):
        return ((x - ref).abs().max() / ref.abs().max()).item()

    before = state.clone()
    parents = tree = (cases.random_parents(t, 9) if t > 1 else torch.tensor([-1])).cuda()
    out = tree_verify(q, k, v, g, beta, state, parents)
    assert torch.equal(state, before)
    assert rel(out, tree_verify_reference(q, k, v, g, beta, state, parents)) <= 1e-4
    if t > 1:  # a full 64-node tree and a 64-node chain (depth 63: the most rounds) too
        args = [torch.cat([x] * 3)[:64] for x in (q, k, v, g, beta)]
        for parents in (cases.random_parents(64, 10).cuda(), torch.arange(-1, 63, device="cuda")):
            assert rel(tree_verify(*args, state, parents), tree_verify_reference(*args, state, parents)) <= 1e-4

    ref_state = state.clone()
    ref = recurrent_step_reference(q, k, v, g, beta, ref_state)
    out = recurrent_step(q, k, v, g, beta, state)
    assert rel(out, ref) <= 1e-4 and rel(state, ref_state) <= 1e-4

    if t > 1:  # a verified root-to-leaf path folded in place, padded to the tree's rows, its length on the device
        path = cases.root_to_leaf(tree.cpu()).cuda()
        padded = torch.cat([path, path.new_zeros(t - len(path))])
        ref_state, commit_state = before.clone(), before.clone()
        recurrent_step_reference(*(x[path] for x in (q, k, v, g, beta)), ref_state)
        o, u, gamma = tree_verify_with_fold(q, k, v, g, beta, before, tree)
        assert torch.equal(o, tree_verify(q, k, v, g, beta, before, tree))
        fold_path(k, u, gamma, commit_state, padded, torch.tensor([len(path)], device="cuda"))
        assert rel(commit_state, ref_state) <= 1e-4
        # the same verify left in FoldBuffers and committed for two layers in one launch: fold_path's bits at its
        # launch shape, for every shape the sweep times (benchmarks/sweep_deltanet_tree.py FOLD_SHAPES)
        into = [FoldBuffers.allocate(h, d, hk, d, "cuda") for _ in range(2)]
        for buffers in into:
            assert torch.equal(tree_verify_with_fold(q, k, v, g, beta, before, tree, into=buffers)[1], u)
        for block_v, block_k, warps in FOLD_SHAPES:
            shape = dict(block_v=block_v, block_k=block_k, num_warps=warps)
            alone, layers = before.clone(), [before.clone(), before.clone()]
            fold_path(k, u, gamma, alone, padded, torch.tensor([len(path)], device="cuda"), **shape)
            assert rel(alone, ref_state) <= 1e-4, shape
            fold_layers(FoldTables.of(layers, into), padded, torch.tensor([len(path)], device="cuda"), **shape)
            assert all(torch.equal(layer, alone) for layer in layers), shape

    graph_state = before.clone()  # one decode step captured in a CUDA graph replays in place
    q1, k1, v1, g1, b1 = (x[:1].clone() for x in (q, k, v, g, beta))
    recurrent_step(q1, k1, v1, g1, b1, graph_state.clone())  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = recurrent_step(q1, k1, v1, g1, b1, graph_state)
    graph_state.copy_(before)
    graph.replay()
    ref_state = before.clone()
    ref = recurrent_step_reference(q1, k1, v1, g1, b1, ref_state)
    assert rel(graph_out, ref) <= 1e-4 and rel(graph_state, ref_state) <= 1e-4
