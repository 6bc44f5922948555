"""`bench --fidelity`: the device-against-CPU report, run here with the CPU as the device."""

import torch

from flashtree.bench.fidelity import Run, compare, run_fidelity
from flashtree.engine.loader import load_target


def test_float32_matches_itself_and_bfloat16_does_not(make_gguf, tmp_path):
    path = make_gguf("fidelity", scheme="q4_k_m")
    sequences = [list(range(3, 40)), list(range(50, 90, 2))]
    out = tmp_path / "fidelity.json"
    report = run_fidelity(load_target(path, device="cpu"), "cpu", ["float32", "bfloat16"], sequences, str(out))
    exact, rounded = report["dtypes"]["float32"], report["dtypes"]["bfloat16"]
    assert exact["max_rel_logit_error"] == 0 and max(exact["layer_rel_error"]) == 0
    assert exact["argmax_agree_all"] == exact["positions"] == len(sequences[0]) + len(sequences[1])
    assert 0 < rounded["max_rel_logit_error"] < 0.5
    assert all(e > 0 for e in rounded["layer_rel_error"])
    assert 0 <= rounded["largest_contributor"] < len(rounded["layer_rel_error"])
    # one token a forward (the decode path): float32 differs from the chunked prefill by summation order only
    assert exact["decode"]["max_rel_logit_error"] < 1e-5
    assert exact["decode"]["argmax_agree_decided"] == exact["decode"]["decided_positions"]
    assert 0 < rounded["decode"]["max_rel_logit_error"] < 0.03  # issue #19's bar, design D (docs/FIDELITY.md)
    assert out.exists()


def test_compare_counts_only_decided_positions():
    ref_logits = torch.tensor([[2.0, 0.0, 0.0], [1.0, 0.95, 0.0], [0.0, 3.0, 1.0]])
    run_logits = torch.tensor([[2.0, 0.0, 0.0], [0.9, 1.0, 0.0], [0.0, 2.5, 2.9]])
    hidden = torch.ones(2, 3, 4)
    result = compare(Run(run_logits, hidden * 1.1), Run(ref_logits, hidden))
    assert result["decided_positions"] == 2  # the middle row's margin is 0.05
    assert result["argmax_agree_decided"] == 1 and result["argmax_agree_all"] == 1
    assert abs(result["max_rel_logit_error"] - 1.9 / 3.0) < 1e-6
    assert all(abs(e - 0.1) < 1e-6 for e in result["layer_rel_error"])


def test_transformers_rows_beside_ours(make_gguf):
    """The peer rows: transformers in float32 lands on our CPU float32 reference (an independent
    implementation of the same weights), and in bf16 it is off like ours, by rounding."""
    path = make_gguf("fidelity", scheme="q4_k_m")
    sequences = [list(range(3, 40))]
    report = run_fidelity(load_target(path, device="cpu"), "cpu", ["float32", "bfloat16"], sequences, None, peers=True)
    peers = report["transformers"]
    assert peers["float32"]["max_rel_logit_error"] < 1e-4
    assert peers["float32"]["argmax_agree_all"] == peers["float32"]["positions"] == len(sequences[0])
    assert 0 < peers["bfloat16"]["max_rel_logit_error"] < 0.5
