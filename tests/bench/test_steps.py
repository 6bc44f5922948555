"""`flashtree bench --steps`: every row is measured and the replay run reaches its acceptance length."""

import json

import pytest
import torch

from flashtree.bench.steps import ReplayProposer, q8_sibling, random_draft
from flashtree.cli.main import main
from flashtree.engine.config import GenerationConfig
from flashtree.engine.generate import Engine
from flashtree.engine.loader import random_target
from flashtree.models.random_weights import shape_config
from flashtree.drafting.proposer import DFlashProposer


def test_steps_report_on_cpu(tmp_path, capsys):
    out = tmp_path / "steps.json"
    assert main(["bench", "--synthetic", "tiny", "--steps", "--device", "cpu", "-n", "64", "--repeat", "2",
                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    steps = [r["step"] for r in report["rows"]]
    assert steps[:5] == ["ar step", "verify budget 15", "verify budget 22", "verify budget 32", "verify budget 64"]
    assert {"draft step", "tree build (budget 22)", "walk", "commit (depth-4 path)", "prefill 1024"} <= set(steps)
    assert {f"prefill chunk {n}" for n in (1, 8, 16, 23, 32, 51, 64)} <= set(steps)
    assert all(r["ms"] > 0 for r in report["rows"])
    assert report["weights_bytes_per_step"] > 0 and report["read_bandwidth_GBps"] > 0
    replay = report["replay"]
    assert replay["identical"] and abs(replay["al"] - 5.17) < 0.5  # the last step is cut by -n
    assert "replay e2e" in capsys.readouterr().out


def test_replay_proposer_hits_the_requested_acceptance_length():
    target = random_target(shape_config("tiny"), scheme="f32", device="cpu")
    prompt = list(range(5, 25))
    engine = Engine(target)
    base = GenerationConfig(max_new_tokens=60, ignore_eos=True)
    reference = engine.generate(prompt, base).token_ids
    draft = random_draft(target.config, "cpu", torch.float32)
    for al in (1.0, 2.5, 6.0):
        engine.draft = ReplayProposer(DFlashProposer(target.model, draft, 256), prompt + reference, al)
        # trees on every step, whatever they accept (the adaptive policy would turn AL 1 into AR steps)
        result = engine.generate(prompt, GenerationConfig(max_new_tokens=60, mode="ddtree", ignore_eos=True,
                                                          adaptive=False))
        assert result.token_ids == reference
        assert abs(result.stats.acceptance_length - al) < 0.35, (al, result.stats.acceptance_length)


def test_replay_through_the_static_graph_ready_path():
    """As on CUDA: the whole step as one static function (run eagerly here), with the replay proposer's
    device form of its proposal standing in for the draft's block pass."""
    from flashtree.engine.cuda_graphs import GraphedForward

    target = random_target(shape_config("tiny"), scheme="f32", device="cpu")
    prompt = list(range(5, 25))
    engine = Engine(target)
    engine.runner._graphs = GraphedForward(target.model, capture_graphs=False)
    reference = engine.generate(prompt, GenerationConfig(max_new_tokens=60, ignore_eos=True)).token_ids
    inner = DFlashProposer(target.model, random_draft(target.config, "cpu", torch.float32), 256, capture_graphs=False)
    static_commits, commit_static = [], inner.commit_static
    inner.commit_static = lambda *args: (static_commits.append(args), commit_static(*args))
    engine.draft = ReplayProposer(inner, prompt + reference, 4.0)
    result = engine.generate(prompt, GenerationConfig(max_new_tokens=60, mode="ddtree", ignore_eos=True,
                                                      adaptive=False))  # a tree every step
    assert result.token_ids == reference
    assert abs(result.stats.acceptance_length - 4.0) < 0.35
    # greedy: each step runs as one static function that commits its path before the host sees it, the last
    # one's included (GraphedForward.speculative_step)
    assert len(static_commits) == result.stats.steps


def test_profile_counts_a_steps_operators_by_family(tmp_path):
    out = tmp_path / "steps.json"
    assert main(["bench", "--synthetic", "tiny", "--steps", "--profile", "--device", "cpu", "-n", "8", "--repeat", "2",
                 "--replay-al", "0", "--prefill-lengths", "16", "--context", "32", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    profile = report["profile_ar_step"]
    families = profile["families"]
    assert profile["kernels"] == sum(f["count"] for f in families.values()) > 0
    # a tiny model's every projection is one dense matmul: at least q, k, v, o / the DeltaNet ones, and the MLP's three
    assert families["dense matmul (cuBLAS)"]["count"] >= 3 * shape_config("tiny").num_layers
    assert abs(profile["ms"] - sum(f["ms"] for f in families.values())) < 1e-6
    # the speculative step's parts: the commit adds operators of its own to the verify's
    draft, verify, both = (report[k] for k in ("profile_draft_step", "profile_verify", "profile_verify_and_commit"))
    assert draft["kernels"] > 0 and both["kernels"] > verify["kernels"] > 0
    # ... named: what the commit runs beyond the verify, its counts adding up to the difference
    commit = report["profile_commit_kernels"]
    assert sum(entry["count"] for entry in commit.values()) == both["kernels"] - verify["kernels"] and commit
    # a prefill chunk of the bench's chunk length on the context: more work than one AR step
    chunk = report["profile_prefill_chunk"]
    assert chunk["kernels"] > 0 and chunk["families"]["dense matmul (cuBLAS)"]["count"] >= 3 * shape_config("tiny").num_layers


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_profile_on_the_gpu_splits_the_one_graph_step(tmp_path):
    out = tmp_path / "steps.json"
    assert main(["bench", "--synthetic", "tiny", "--steps", "--profile", "--device", "cuda", "-n", "8", "--repeat", "2",
                 "--replay-al", "0", "--prefill-lengths", "16", "--context", "64", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    step, verify, draft = (report[k] for k in ("profile_speculative_step", "profile_verify", "profile_draft_step"))
    # the one graph holds the draft's and the verify's kernels and the tree build's, the walk's and the commit's
    assert step["kernels"] > verify["kernels"] + draft["kernels"]
    assert report["profile_tree_walk_commit_ms"] == pytest.approx(step["ms"] - verify["ms"] - draft["ms"], abs=1e-3)
    inside = report["profile_tree_walk_commit_kernels"]  # by name, the commit's kernels among them
    assert sum(entry["count"] for entry in inside.values()) == step["kernels"] - verify["kernels"] - draft["kernels"]
    assert any("fold" in name for name in inside)
    # the whole process after each phase: at least the allocator's peak so far
    footprint, allocated = report["footprint_by_phase_GiB"], report["peak_memory_by_phase_GiB"]
    assert list(footprint) == list(allocated) and all(footprint[p] >= allocated[p] for p in footprint)


def test_family_names():
    from flashtree.bench.profile import family

    assert family("qmm_q4_k_r1_t1_w4_s1") == "Q4_K matmul"
    assert family("_q6_k_tiled") == "Q6_K matmul"
    assert family("sm90_xmma_gemm_bf16bf16") == "dense matmul (cuBLAS)"
    assert family("_rms_norm_kernel") == "RMSNorm"
    assert family("add_rms_norm_f32_q4_k") == "RMSNorm"  # it writes the Q4_K matmul's float16 x as well
    assert family("prep_x_f16_q6_k_xf32") == "float16 x conversions"
    assert family("void at::native::vectorized_elementwise_kernel<4>") == "elementwise and reductions"
    assert family("something_new") == "other"


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU this would run the whole kernel benchmark")
def test_kernel_bench_without_a_gpu_says_so(capsys):
    assert main(["bench", "--kernels"]) != 0
    assert "no CUDA device" in capsys.readouterr().err


def test_q8_sibling_shares_the_drafts_tensors_and_leaves_it_whole():
    draft = random_draft(shape_config("tiny"), "cpu", torch.float32)
    sibling = q8_sibling(draft)
    assert sibling.fc.weight is draft.fc.weight  # shared, not copied
    assert isinstance(draft.layers[0].mlp.up_proj, torch.nn.Linear)  # the original keeps its float layers
    assert type(sibling.layers[0].mlp.up_proj).__name__ == "_Q8Linear"


def test_random_draft_of_draft_type_q8_0_has_its_layers_packed():
    """`bench --synthetic --draft-type q8_0` measures a draft whose layer matrices are Q8_0 (and no side-by-side
    Q8_0 copy): the random draft is built so."""
    draft = random_draft(shape_config("tiny"), "cpu", torch.float32, draft_type="q8_0")
    assert type(draft.layers[0].mlp.up_proj).__name__ == "_Q8Linear"
    assert not any(name.startswith("layers.") and p.dim() == 2 for name, p in draft.named_parameters())
    assert draft.fc.weight.dtype == torch.float32


OUT_OF_MEMORY = ("CUDA out of memory. Tried to allocate 340.00 MiB. GPU 0 has a total capacity of 139.80 GiB of which "
                 "117.13 GiB is free. 22.20 GiB allowed; Of the allocated memory 21.21 GiB is allocated by PyTorch")


def test_a_row_out_of_memory_is_reported_and_the_run_goes_on(tmp_path, capsys, monkeypatch):
    """Under a --gpu-memory cap a prefill row may not fit (the H200 at 23 GiB and 262K tokens, 2026-12-02): it is
    reported as out of memory, and the other rows and the report still come out."""
    import flashtree.bench.steps as steps

    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError(OUT_OF_MEMORY)

    monkeypatch.setattr(steps, "_prefill", no_memory)
    out = tmp_path / "steps.json"
    assert main(["bench", "--synthetic", "tiny", "--steps", "--device", "cpu", "-n", "16", "--repeat", "1",
                 "--replay-al", "0", "--out", str(out)]) == 0
    rows = {r["step"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["prefill 1024"]["error"] == "out of memory"
    assert rows["prefill 1024"]["detail"].endswith("22.20 GiB allowed")
    assert rows["ar step"]["ms"] > 0 and rows["verify budget 64"]["ms"] > 0
    assert "prefill 1024             out of memory  CUDA out of memory. Tried to allocate 340.00 MiB." in capsys.readouterr().out


def test_steps_of_one_configuration_only(tmp_path):
    """`--verify-budgets 22 --chunk-lengths none --prefill-lengths none`: the context and budget-22 decoding alone
    (issue #20's 24 GiB configuration), so that the run's memory is that configuration's."""
    out = tmp_path / "steps.json"
    assert main(["bench", "--synthetic", "tiny", "--steps", "--device", "cpu", "-n", "16", "--repeat", "1",
                 "--replay-al", "0", "--verify-budgets", "22", "--chunk-lengths", "none", "--prefill-lengths", "none",
                 "--out", str(out)]) == 0
    steps = [r["step"] for r in json.loads(out.read_text())["rows"]]
    assert steps[:2] == ["ar step", "verify budget 22"]
    assert not [s for s in steps if s.startswith(("verify budget 15", "verify budget 32", "verify budget 64",
                                                   "prefill"))]
    assert {"draft step", "tree build (budget 22)", "walk", "commit (depth-4 path)"} <= set(steps)


@pytest.mark.parametrize("flag, value, expected", [
    ("--verify-budgets", "0", "positive tree budgets up to 127"),
    ("--verify-budgets", "22,128", "positive tree budgets up to 127"),
    ("--verify-budgets", "", "or none"),
    ("--chunk-lengths", "8,x", "positive token counts, or none"),
])
def test_steps_row_lists_name_the_problem(flag, value, expected, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--synthetic", "tiny", "--steps", "--device", "cpu", flag, value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and expected in err and "Traceback" not in err
