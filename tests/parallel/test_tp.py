"""Tensor parallel: sharding rules on one process, then one spawned gloo group of 2 CPU ranks."""

import json
import os
from pathlib import Path

import pytest

from flashtree.cli.main import main
from flashtree.engine.config import EngineArgs
from flashtree.engine.loader import load_engine, load_target
from flashtree.errors import FlashtreeError
from flashtree.models.synthetic import tiny_config
from flashtree.parallel import CHILD_ENV, launch, tp
from tests.drafting.test_lossless import random_draft

ROOT = Path(__file__).resolve().parents[2]


def test_deltanet_shard_keeps_tiled_value_heads_with_their_qk_heads():
    c = tiny_config(gdn_qk_heads=4, gdn_v_heads=12)
    seen = []
    for rank in range(2):
        qk, v = tp.deltanet_heads(c, rank, 2)
        local_qk = len(qk)
        for local_h, global_h in enumerate(v.tolist()):
            # the local tiled rule must point at the same q/k head as the global one
            assert qk[local_h % local_qk] == global_h % c.gdn_qk_heads
        seen += v.tolist()
    assert sorted(seen) == list(range(12))


def test_local_config_refuses_partial_heads():
    c = tiny_config()
    assert tp.local_config(c, 2).num_kv_heads == 1
    with pytest.raises(FlashtreeError, match="divisible"):
        tp.local_config(c, 4)  # 2 KV heads over 4 ranks


def test_tensor_parallel_refuses_the_other_placements():
    for placement in ({"gpus": 2}, {"layer_split": "1,1"}, {"draft_device": "cuda:1"}):
        with pytest.raises(FlashtreeError, match="--tensor-parallel does not combine"):
            tp.check_placement(2, **placement)
    tp.check_placement(2, gpus=1)
    tp.check_placement(1, gpus=2, layer_split="1,1", draft_device="cuda:1")  # no tensor parallel: any placement


def test_load_engine_refuses_a_tensor_parallel_draft_device_before_loading(make_gguf, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)  # joining a group would fail first, with another error
    args = EngineArgs(model=make_gguf("spec"), device="cpu", tensor_parallel=2, draft_device="cpu")
    with pytest.raises(FlashtreeError, match="does not combine with --gpus / --layer-split / --draft-device"):
        load_engine(args)


def test_rank_env_turns_nvlink_multicast_off():
    env = launch.rank_env(1, 2, 12345, base={})
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert (env["RANK"], env["WORLD_SIZE"], env["MASTER_PORT"]) == ("1", "2", "12345")
    assert CHILD_ENV["NCCL_NVLS_ENABLE"] == "0"


def test_two_gloo_ranks_match_one_process(make_gguf, tmp_path, monkeypatch):
    gguf = make_gguf("spec", config=tiny_config(num_layers=4, gdn_v_heads=4))
    quantized = make_gguf("spec-q8", config=tiny_config(num_layers=4, gdn_v_heads=4), scheme="q8_0")
    path = os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")])
    monkeypatch.setenv("PYTHONPATH", path)
    code = launch.spawn_ranks([str(gguf), str(tmp_path), str(quantized)], 2, module="tests.parallel.tp_worker")
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)
               if (tmp_path / f"rank{r}.json").exists()]
    errors = [r.get("error") for r in reports if "error" in r]
    assert code == 0 and len(reports) == 2, errors
    for report in reports:
        assert "process group has 2 ranks" in report["wrong_world"]
        assert report["cache_kv_heads"] == 1  # each rank caches only its own KV heads
        assert report["forward_max_diff"] < 1e-3, report  # float sums split over ranks
        # Q8_0 shards kept as blocks: column-parallel and row-parallel ones with whole 32-value blocks, the
        # DeltaNet output (16-column head runs) dense; the same logits as one process
        kinds = report["quantized"]["kinds"]
        assert kinds["QuantLinear"] and kinds["RowParallelQuantLinear"] and kinds["RowParallelLinear"], kinds
        assert kinds["QuantLinear head"] == 1 and report["quantized"]["max_diff"] < 1e-3, report["quantized"]
    checks = dict((name, ok) for name, ok in reports[0]["checks"])
    assert checks == {"ar": True, "ddtree": True, "chain": True, "oracle": True, "cancel": True}, checks
    assert dict(reports[1]["checks"]) == {"oracle": True}


def test_cli_tensor_parallel_run_matches_one_process(make_gguf, tmp_path, monkeypatch, capfd):
    """`flashtree run -tp 2` spawns two ranks itself (rank 0 prints, rank 1 follows and exits)."""
    gguf = make_gguf("spec", config=tiny_config(num_layers=4, gdn_v_heads=4))
    random_draft(load_target(gguf, device="cpu")).save(tmp_path / "draft")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    argv = ["run", "hello world", "-m", str(gguf), "--draft", str(tmp_path / "draft"), "--device", "cpu", "--raw",
            "-n", "16", "--json", "--ignore-eos", "--budget", "8", "--topk", "4"]
    outputs = []
    for extra in ([], ["-tp", "2"], ["--layer-split", "1,3"]):
        assert main(argv + extra) == 0
        outputs.append(json.loads(capfd.readouterr().out.strip().splitlines()[-1]))
    assert outputs[0]["mode"] == "ddtree" and len(outputs[0]["token_ids"]) == 16
    assert outputs[1]["token_ids"] == outputs[0]["token_ids"] == outputs[2]["token_ids"]


def test_synthetic_bench_runs_on_every_rank(tmp_path, monkeypatch, capfd):
    """`flashtree bench --synthetic ... -tp 2 --steps`: every rank builds its shard of the random model and
    runs the benchmark in lock step (no hang); rank 0 alone prints and writes the JSON, whose replay
    reproduces its record and AR."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "tp.json"
    assert main(["bench", "--synthetic", "tiny", "--echo", "--device", "cpu", "--steps", "-n", "8", "--repeat", "1",
                 "--context", "64", "--prefill-lengths", "64", "--replay-al", "2", "-tp", "2", "--out", str(out)]) == 0
    printed = capfd.readouterr().out
    assert printed.count("ar step") == 1 and "rank 0's shard" in printed  # rank 1 printed nothing
    report = json.loads(out.read_text())
    assert report["tensor_parallel"] == 2 and {r["step"] for r in report["rows"]} >= {"ar step", "verify budget 22"}
    assert report["replay"]["identical"] and report["replay"]["identical_to_ar"]
