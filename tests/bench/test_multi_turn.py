"""`flashtree bench --multi-turn`: each turn's text is the same with the prefix cache on and off, and a
turn after the first restores the shared prefix from the cache -- also in DDTree mode, whose requests
end inside a verified tree (its scratch never committed), which once made the cache store nothing."""

import json

from flashtree.cli.main import main


def test_multi_turn_report_on_cpu(tmp_path):
    out = tmp_path / "multi_turn.json"
    assert main(["bench", "--multi-turn", "--modes", "ddtree", "--turns", "3", "--system-tokens", "96", "--prefill-chunk", "32",
                 "--prefix-cache-interval", "32", "-n", "4", "--device", "cpu", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert len(rows) == 3 and all(r["identical"] for r in rows), rows
    assert rows[0]["cached_tokens"] == 0 and all(r["cached_tokens"] > 0 for r in rows[1:]), rows
    assert report["mode"] == "ddtree" and report["prefix_cache_entries"] > 0
