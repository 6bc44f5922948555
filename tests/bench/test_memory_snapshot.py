"""`bench --memory-snapshot`: the allocator's snapshot summarised by pool, flashtree line and free block."""

import json
import pickle

import pytest
import torch

from flashtree.bench.memory_snapshot import block_site, format_summary, main as snapshot_main, summarize
from flashtree.cli.main import main

MIB = 2**20


def frames(*files_lines):
    return [{"filename": f, "line": line, "name": "fn"} for f, line in files_lines]


ATTENTION = "/site/flashtree/models/attention.py"
CACHE = "/site/flashtree/models/cache.py"
TORCH = "/site/torch/nn/functional.py"

# two segments of the default pool and one of a graph pool, in the layout PyTorch's `_snapshot` writes
SNAPSHOT = {"segments": [
    {"device": 0, "segment_type": "large", "segment_pool_id": (0, 0), "stream": 0, "blocks": [
        {"size": 100 * MIB, "state": "active_allocated", "frames": frames((TORCH, 1), (CACHE, 92))},
        {"size": 30 * MIB, "state": "inactive", "frames": []},
        {"size": 20 * MIB, "state": "active_allocated", "frames": frames((ATTENTION, 120), (CACHE, 10))},
    ]},
    {"device": 0, "segment_type": "small", "segment_pool_id": (0, 0), "stream": 0, "blocks": [
        {"size": MIB // 2, "state": "active_allocated", "frames": []},
        {"size": 3 * MIB // 2, "state": "inactive", "frames": []},
    ]},
    {"device": 0, "segment_type": "large", "segment_pool_id": (1, 2), "stream": 7, "blocks": [
        {"size": 40 * MIB, "state": "active_allocated", "frames": frames((ATTENTION, 120))},
    ]},
    {"device": 1, "segment_type": "large", "segment_pool_id": (0, 0), "stream": 0, "blocks": [
        {"size": 500 * MIB, "state": "active_allocated", "frames": frames((CACHE, 92))},
    ]},
]}


def test_block_site_is_the_innermost_flashtree_line():
    assert block_site(frames((TORCH, 1), (CACHE, 92), (ATTENTION, 5))) == "models/cache.py:92 fn"
    assert block_site(frames((TORCH, 1), ("/site/fla/ops/chunk.py", 40))) == "chunk.py:40 fn"
    assert block_site([]) == "<no stack>"


def test_summary_splits_the_reservation_by_pool_and_the_live_memory_by_line():
    summary = summarize(SNAPSHOT, device=0)
    assert summary.reserved == 192 * MIB and summary.live == int(160.5 * MIB)
    default_large = summary.pools[("default", "large", 0)]
    assert (default_large.reserved, default_large.live, default_large.free) == (150 * MIB, 120 * MIB, 30 * MIB)
    assert summary.pools[("graph pool 1.2", "large", 7)].free == 0
    assert summary.sites["models/attention.py:120 fn"] == [60 * MIB, 2]
    assert summary.sites["models/cache.py:92 fn"] == [100 * MIB, 1]  # device 1's block is not counted
    largest = summary.free_blocks[0]
    assert largest.size == 30 * MIB and largest.before == "models/cache.py:92 fn"
    assert largest.after == "models/attention.py:120 fn" and largest.where == "default large"
    text = format_summary(summary)
    assert "192.0 MiB reserved, 160.5 MiB live, 31.5 MiB kept free" in text
    assert "graph pool 1.2" in text and "models/cache.py:92 fn" in text


def test_the_module_prints_a_written_snapshot_again(tmp_path, capsys):
    path = tmp_path / "snapshot.pickle"
    path.write_bytes(pickle.dumps(SNAPSHOT))
    assert snapshot_main([str(path)]) == 0
    assert "models/cache.py:92 fn" in capsys.readouterr().out


@pytest.mark.parametrize("content, expected", [(b"not a pickle", "cannot read snapshot"),
                                               (pickle.dumps({"other": 1}), "not an allocator snapshot")])
def test_the_module_names_a_file_it_cannot_read(tmp_path, capsys, content, expected):
    path = tmp_path / "snapshot.pickle"
    path.write_bytes(content)
    assert snapshot_main([str(path)]) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err


def test_memory_snapshot_needs_steps_and_cuda(capsys, tmp_path):
    assert main(["bench", "--synthetic", "tiny", "--device", "cpu", "--memory-snapshot", str(tmp_path / "s")]) != 0
    assert "add --steps" in capsys.readouterr().err
    assert main(["bench", "--synthetic", "tiny", "--steps", "--device", "cpu", "-n", "8", "--repeat", "1",
                 "--memory-snapshot", str(tmp_path / "s")]) != 0
    err = capsys.readouterr().err
    assert "--device cuda" in err and "Traceback" not in err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_memory_snapshot_of_a_steps_run_on_the_gpu(tmp_path, capsys):
    out, path = tmp_path / "steps.json", tmp_path / "snapshot.pickle"
    made_before = torch.cuda.memory_allocated()  # an earlier GPU test's in this process (cuBLAS workspaces, graphs)
    assert main(["bench", "--synthetic", "tiny", "--steps", "--device", "cuda", "-n", "8", "--repeat", "2",
                 "--replay-al", "0", "--prefill-lengths", "none", "--chunk-lengths", "none", "--context", "64",
                 "--out", str(out), "--memory-snapshot", str(path)]) == 0
    phases = json.loads(out.read_text())["memory_snapshot_by_phase"]
    assert list(phases)[:2] == ["load", "context prefill"] and "reserved" in phases["context prefill"]
    summary = summarize(pickle.loads(path.read_bytes()), device=0)
    assert summary.live > 0 and summary.reserved >= summary.live
    # recorded from before the load: the weights, the draft and the cache are held by flashtree lines. Blocks made
    # before the recording have no stack: little of the run's own, and whatever an earlier GPU test in this process
    # left live (on an H100, after tests/models/test_dflash_cuda.py's captured passes in the same worker: two 32
    # MiB cuBLAS workspaces, one in the default pool and one in a graph's)
    assert summary.sites.get("<no stack>", [0])[0] <= max(made_before, summary.live / 4)
    assert any(site.startswith("models/weight_pool.py") for site in summary.sites)  # the weights' copies
    assert any(site.startswith(("bench/", "models/dflash.py")) for site in summary.sites)
    assert "live memory by site" in capsys.readouterr().err
