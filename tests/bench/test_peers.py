"""`flashtree bench --peers`: transformers greedy and the z-lab dflash loop on the same prompts."""

import json

import pytest

from flashtree.cli.main import main


def test_peer_rows_on_the_demo_pair(tmp_path):
    pytest.importorskip("dflash.model")
    out = tmp_path / "peers.json"
    assert main(["bench", "--device", "cpu", "--prompts", "1", "-n", "24", "--modes", "ar,ddtree", "--peers",
                 "--out", str(out)]) == 0
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"ar", "ddtree", "hf-ar", "zlab-dflash"}
    assert rows["hf-ar"]["identical_to_ar"] == 1  # the same weights decode the same greedy tokens
    assert rows["ddtree"]["identical_to_ar"] == 1
    zlab = rows["zlab-dflash"]
    assert zlab["new_tokens"] == 24 and zlab["steps"] >= 2 and zlab["tokens_per_s"] > 0


def test_transformers_peer_of_an_in_memory_synthetic_target(tmp_path):
    out = tmp_path / "peers.json"
    assert main(["bench", "--synthetic", "tiny", "--device", "cpu", "--prompts", "2", "-n", "12", "--peers",
                 "--out", str(out)]) == 0
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"ar", "hf-ar"} and rows["hf-ar"]["identical_to_ar"] == 2
