"""The DeltaNet tree verify in CUDA C (kernels/deltanet_tree.cu): its entry's arguments against the kernel's
argument struct, its NVRTC compile, and the kernel built for the host (its threads as host threads) against the
torch reference, on any machine; on a Hopper GPU, its outputs (and the commit's u, Gamma and
keys) against the torch reference and the Triton kernel at every node tile, graphed."""

import functools
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from flashtree.errors import FlashtreeError
from flashtree.kernels import gated_delta, gated_delta_cuda
from flashtree.kernels.gated_delta_triton import (FOLD_ROWS, FoldBuffers, ancestors_from_parents,
                                                  tree_verify_reference, tree_verify_with_fold)

from tests.kernels import gated_delta_triton_cases as cases


@pytest.mark.parametrize("clocks", [False, True])
def test_entry_passes_the_struct_fields_in_order(clocks):
    """The extern "C" entry builds TreeArgs by position: its field list must be the struct's, name for name (the
    phase-clock instance's struct with its TREE_PHASE_CLOCKS field)."""
    text = gated_delta_cuda.SOURCE.read_text()
    body = re.search(r"struct TreeArgs \{(.*?)\};", text, re.S).group(1)
    body = re.sub(r"#ifdef TREE_PHASE_CLOCKS(.*?)#endif", r"\1" if clocks else "", body, flags=re.S)
    declared = re.findall(r"\*?(\w+)\s*(?=[,;])", re.sub(r"(const )?(float|long long|int)\s*", "", body))
    entry = gated_delta_cuda.wrapper(128, 24, clocks)
    passed = re.search(r"TreeArgs a = \{(.*?)\};", entry).group(1).replace(" ", "").split(",")
    assert declared == passed and ("clocks" in passed) == clocks


def test_phase_clocks_take_one_row_of_words_a_cta():
    q = torch.zeros(3, 2, 128)
    args = (q, q, torch.zeros(3, 2, 64), torch.zeros(3, 2), torch.zeros(3, 2), torch.zeros(2, 128, 64),
            torch.tensor([-1, 0, 1]), *(torch.zeros(3, 2, 64),) * 3, q, True, False)
    with pytest.raises(FlashtreeError, match=r"int64 \[2, 2, 10\]"):
        gated_delta_cuda.tree_verify(*args, clocks=torch.zeros(2, 2, 9, dtype=torch.int64))


def test_shared_memory_fits_hopper_and_tiles_cover_the_verify():
    assert max(gated_delta_cuda.shared_bytes(d, n) for d in gated_delta_cuda.HEAD_DIMS
               for n in gated_delta_cuda.NODE_TILES) <= 227 * 1024
    assert [gated_delta_cuda.node_tile(t) for t in (1, 8, 9, 17, 23, 24, 25, 32)] == [8, 8, 16, 24, 24, 24, 32, 32]


def test_cpu_tensors_take_the_other_kernels():
    q = torch.zeros(3, 2, 128)
    assert not gated_delta_cuda.takes(q, q, torch.zeros(3, 2, 64), torch.zeros(3, 2), torch.zeros(3, 2),
                                      torch.zeros(2, 128, 64), torch.tensor([-1, 0, 1]))
    assert gated_delta_cuda.cuda_jobs(torch.device("cpu"), 128) == []


def test_instances_compile_for_sm90_without_a_gpu():
    """CI has no GPU: this keeps the CUDA source compiling (NVRTC where cuda-python finds it)."""
    pytest.importorskip("cuda.bindings")
    from flashtree.nvrtc import compile_cubin

    try:
        compile_cubin('extern "C" __global__ void probe() {}', "sm_90")
    except Exception:  # noqa: BLE001 - no libnvrtc: nothing to compile with
        pytest.skip("needs NVRTC")
    for dk, nodes, clocks, warps in ((128, 24, False, 4), (128, 32, False, 4), (32, 8, False, 4), (128, 24, True, 4),
                                     (128, 24, False, 8), (32, 8, True, 8)):
        assert compile_cubin(gated_delta_cuda.source(dk, nodes, clocks, warps), "sm_90")[:4] == b"\x7fELF"


def test_the_tree_kernel_takes_8_warps_unless_asked_for_4(monkeypatch):
    """The tree kernel takes the 8-warp instances (a name and a define of their own) by default, the 4-warp ones
    with FLASHTREE_TREE_EIGHT_WARPS=0."""
    monkeypatch.setenv("FLASHTREE_TREE_EIGHT_WARPS", "0")
    assert gated_delta_cuda.tree_warps() == 4 and gated_delta_cuda.instance(128, 24) == "deltanet_tree_d128_n24"
    monkeypatch.delenv("FLASHTREE_TREE_EIGHT_WARPS")
    assert gated_delta_cuda.tree_warps() == 8
    assert gated_delta_cuda.instance(128, 24, warps=8) == "deltanet_tree_d128_n24_w8"
    source = gated_delta_cuda.source(128, 24, warps=8)
    assert source.startswith("#define TREE_WARPS 8\n") and "__launch_bounds__(256) deltanet_tree_d128_n24_w8(" in source


hopper = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
                                 and gated_delta_cuda._available(torch.device("cuda"))),
                            reason="needs a CUDA GPU of sm_90+ and NVRTC")


def _inputs(t: int, hk: int, h: int, dk: int, dv: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(t, hk, dk, generator=gen, device="cuda") * dk**-0.5
    k = F.normalize(torch.randn(t, hk, dk, generator=gen, device="cuda"), dim=-1)
    v = torch.randn(t, h, dv, generator=gen, device="cuda")
    g = -torch.rand(t, h, generator=gen, device="cuda")
    beta = torch.rand(t, h, generator=gen, device="cuda")
    return q, k, v, g, beta, torch.randn(h, dk, dv, generator=gen, device="cuda")


def _rel(x, ref):
    return ((x - ref).abs().max() / ref.abs().max()).item()


TREES = {"one": [-1], "chain8": list(range(-1, 7)), "chain16": list(range(-1, 15)), "chain23": list(range(-1, 22)),
         "random23": None,
         "star23": [-1] + [0] * 22, "chain24": list(range(-1, 23)), "chain32": list(range(-1, 31)),
         "random32": None, "forest20": [-1, -1, 0, 1, 2, -1, 5, 3, 7, 6, 8, 9, 4, -1, 13, 14, 10, 16, 11, 18]}


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("tree", list(TREES))
@pytest.mark.parametrize("shape", [(16, 48, 128, 128), (48, 48, 128, 128), (2, 4, 64, 64)])
def test_cuda_tree_verify_against_reference_and_triton(tree, shape):
    """Every node tile and tree kind at the 27B shape (q/k on 16 heads, or expanded to the 48 value heads as the
    engine passes them) and a small one: outputs within float32 rounding of the reference; the commit's u, Gamma
    and keys those of the Triton kernel; the state untouched."""
    torch.backends.cuda.matmul.allow_tf32 = False
    hk, h, dk, dv = shape
    parents = TREES[tree]
    t = len(parents) if parents is not None else int(tree.removeprefix("random"))
    parents = (torch.tensor(parents) if parents is not None else cases.random_parents(t, t)).cuda()
    q, k, v, g, beta, state = _inputs(t, hk, h, dk, dv, seed=t + hk)
    assert gated_delta_cuda.takes(q, k, v, g, beta, state, parents)
    before = state.clone()
    o, u, gamma = tree_verify_with_fold(q, k, v, g, beta, state, parents)
    assert torch.equal(state, before)
    assert _rel(o, tree_verify_reference(q, k, v, g, beta, state, parents)) <= 2e-5
    o_t, u_t, gamma_t = tree_verify_with_fold(q, k, v, g, beta, state, parents, precision="ieee", cuda=False)
    assert _rel(o, o_t) <= 2e-5 and _rel(u, u_t) <= 2e-5 and _rel(gamma, gamma_t) <= 1e-6
    if t <= FOLD_ROWS:  # the engine's buffers (a larger verify leaves its rows in tensors of its own)
        into = FoldBuffers.allocate(h, dv, hk, dk, "cuda")
        o_into, u_into, gamma_into = tree_verify_with_fold(q, k, v, g, beta, state, parents, into=into)
        assert torch.equal(o_into, o) and torch.equal(u_into, u) and torch.equal(gamma_into, gamma)
        assert torch.equal(into.k[:t], k)  # the commit's keys, one CTA per key head


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("tree", ["chain23", "random23", "star23", "chain8", "random32"])
def test_cuda_tree_verify_on_8_warps_gives_the_4_warp_bits(monkeypatch, tree):
    """FLASHTREE_TREE_EIGHT_WARPS=1: the same sums in the same order on twice the warps, so o, u and Gamma equal the
    4-warp kernel's bit for bit (at the 27B shape, 48 value heads over 16 key heads)."""
    parents = TREES[tree]
    t = len(parents) if parents is not None else int(tree.removeprefix("random"))
    parents = (torch.tensor(parents) if parents is not None else cases.random_parents(t, t)).cuda()
    q, k, v, g, beta, state = _inputs(t, 16, 48, 128, 128, seed=t)
    monkeypatch.setenv("FLASHTREE_TREE_EIGHT_WARPS", "0")
    four = tree_verify_with_fold(q, k, v, g, beta, state, parents)
    monkeypatch.setenv("FLASHTREE_TREE_EIGHT_WARPS", "1")
    eight = tree_verify_with_fold(q, k, v, g, beta, state, parents)
    assert all(torch.equal(a, b) for a, b in zip(four, eight))


@pytest.mark.gpu
@hopper
def test_cuda_tree_verify_replays_in_a_graph_and_treats_bad_parents_as_roots():
    """Captured once, a replay reads the inputs' new values; a parent at or after its node counts as -1 (the
    Triton kernel's rule), and the launch does not read past the tree."""
    q, k, v, g, beta, state = _inputs(23, 48, 48, 128, 128, seed=5)
    parents = cases.random_parents(23, 3).cuda()
    tree_verify_with_fold(q, k, v, g, beta, state, parents)  # load the function outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, _, _ = tree_verify_with_fold(q, k, v, g, beta, state, parents)
    v.copy_(torch.randn_like(v))
    graph.replay()
    assert _rel(o, tree_verify_reference(q, k, v, g, beta, state, parents)) <= 2e-5
    bad = parents.clone()
    bad[[4, 9]] = torch.tensor([7, 9], device="cuda")  # after itself, itself
    fixed = bad.clone()
    fixed[[4, 9]] = -1
    assert torch.equal(tree_verify_with_fold(q, k, v, g, beta, state, bad)[0],
                       tree_verify_with_fold(q, k, v, g, beta, state, fixed)[0])


@pytest.mark.gpu
@hopper
def test_phase_clock_instance_gives_the_same_outputs_and_ordered_stamps():
    """The phase-clock instance (`sweep_deltanet_tree.py --phases`) leaves the outputs bit for bit, and each CTA's
    stamps rise through the phases on one SM, its global-timer span positive."""
    q, k, v, g, beta, state = _inputs(23, 16, 48, 128, 128, seed=3)
    parents = cases.random_parents(23, 4).cuda()
    outs = [torch.empty_like(v) for _ in range(4)]
    gammas = [torch.empty(23, 48, device="cuda") for _ in range(2)]
    clocks = torch.zeros(128 // gated_delta_cuda.COLS, 48, gated_delta_cuda.PHASE_WORDS, dtype=torch.int64,
                         device="cuda")
    gated_delta_cuda.tree_verify(q, k, v, g, beta, state, parents, outs[0], outs[1], gammas[0], outs[0], True, False)
    gated_delta_cuda.tree_verify(q, k, v, g, beta, state, parents, outs[2], outs[3], gammas[1], outs[2], True, False,
                                 clocks=clocks)
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[3]) and torch.equal(gammas[0], gammas[1])
    words = clocks.view(-1, gated_delta_cuda.PHASE_WORDS)
    assert bool((words[:, 1:7] >= words[:, :6]).all()) and bool((words[:, 9] > words[:, 8]).all())
    assert bool((words[:, 7] < torch.cuda.get_device_properties(0).multi_processor_count).all())


HOST_HARNESS = Path(__file__).with_name("deltanet_tree_host.cpp")
HOST_CASES = [("chain23", 128, 64, 2, 4), ("random23", 128, 64, 2, 4), ("star23", 128, 32, 1, 3),
              ("forest20", 128, 64, 4, 4), ("one", 128, 32, 1, 1), ("chain32", 64, 64, 2, 2),
              ("random32", 128, 32, 2, 2), ("chain16", 32, 32, 1, 2)]


@functools.cache
def _host_build(dk: int, nodes: int, warps: int, tmp: Path) -> Path:
    """deltanet_tree.cu with one entry, built for the host around tests/kernels/deltanet_tree_host.cpp."""
    folder = tmp / f"d{dk}_n{nodes}_w{warps}"
    folder.mkdir()
    (folder / "kernel.cu").write_text(gated_delta_cuda.source(dk, nodes, warps=warps))
    binary = folder / "tree"
    entry = gated_delta_cuda.instance(dk, nodes, warps=warps)
    subprocess.run(["g++", "-std=c++20", "-O1", "-pthread", f"-DENTRY={entry}", f"-I{folder}", str(HOST_HARNESS),
                    "-o", str(binary)], check=True, capture_output=True)
    return binary


@pytest.fixture(scope="module")
def host_builds(tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.skip("needs g++ (the CUDA C kernel built for the host)")
    tmp = tmp_path_factory.mktemp("deltanet_tree_host")
    return lambda dk, nodes, warps=gated_delta_cuda.WARPS: _host_build(dk, nodes, warps, tmp)


def _run_host(binary: Path, stdin: bytes, t: int, h: int, hk: int, dk: int, dv: int):
    run = subprocess.run([str(binary)], input=stdin, capture_output=True, check=True)
    flat = torch.from_numpy(np.frombuffer(run.stdout, dtype=np.float32).copy())
    sizes = (t * h * dv, t * h * dv, t * h, t * hk * dk)
    shapes = ((t, h, dv), (t, h, dv), (t, h), (t, hk, dk))
    return [part.reshape(shape) for part, shape in zip(flat.split(sizes), shapes)]


@pytest.mark.parametrize("warps", [4, 8])
@pytest.mark.parametrize("case", HOST_CASES, ids=[c[0] for c in HOST_CASES])
def test_cuda_kernel_built_for_the_host_matches_the_reference(host_builds, case, warps):
    """The CUDA C kernel's threads as host threads (deltanet_tree_host.cpp): o, and the commit's u, Gamma and keys,
    against the torch reference at every node tile, with the q/k heads shared by several value heads; shared memory
    starts as NaN, so a read before a write shows. On 8 warps (FLASHTREE_TREE_EIGHT_WARPS=1) every sum keeps its
    order, so the outputs are the 4-warp kernel's bit for bit."""
    tree, dk, dv, hk, h = case
    parents = TREES[tree]
    t = len(parents) if parents is not None else int(tree.removeprefix("random"))
    parents = torch.tensor(parents) if parents is not None else cases.random_parents(t, t)
    gen = torch.Generator().manual_seed(t)
    q = torch.randn(t, hk, dk, generator=gen) * dk**-0.5
    k = F.normalize(torch.randn(t, hk, dk, generator=gen), dim=-1)
    v, g, beta = torch.randn(t, h, dv, generator=gen), -torch.rand(t, h, generator=gen), torch.rand(t, h, generator=gen)
    state = torch.randn(h, dk, dv, generator=gen)
    stdin = (np.array([t, hk, h, dk, dv], dtype=np.int32).tobytes()
             + b"".join(x.numpy().astype(np.float32).tobytes() for x in (q, k, v, g, beta, state))
             + parents.numpy().astype(np.int64).tobytes())
    nodes = gated_delta_cuda.node_tile(t)
    o, u, gamma, k_out = _run_host(host_builds(dk, nodes, warps), stdin, t, h, hk, dk, dv)
    if warps != gated_delta_cuda.WARPS:
        four = _run_host(host_builds(dk, nodes), stdin, t, h, hk, dk, dv)
        assert all(torch.equal(a, b) for a, b in zip((o, u, gamma, k_out), four))
    rep = h // hk
    ref_o, ref_u, ref_gamma = gated_delta.ancestor_chunk(q.repeat(1, rep, 1), k.repeat(1, rep, 1), v, g, beta, state,
                                                         ancestors_from_parents(parents))
    assert _rel(o, ref_o) <= 2e-5 and _rel(u, ref_u) <= 2e-5 and _rel(gamma, ref_gamma) <= 1e-6
    assert torch.equal(k_out, k)
