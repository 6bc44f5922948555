"""`flashtree bench --multi-turn`: each turn's text is the same with the prefix cache on and off, and a
turn after the first restores the shared prefix from the cache, up to the previous turn's assistant header --
also in DDTree mode, whose requests
end inside a verified tree (its scratch never committed), which once made the cache store nothing. Per
turn the report gives the forwards of both runs and the cache's own costs."""

import json

from flashtree.cli.main import main


def test_multi_turn_report_on_cpu(tmp_path):
    out = tmp_path / "multi_turn.json"
    assert main(["bench", "--multi-turn", "--modes", "ddtree", "--turns", "3", "--system-tokens", "96",
                 "--prefill-chunk", "32", "--prefix-cache-interval", "32", "-n", "4", "--device", "cpu",
                 "--sessions", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert report["sessions"] == 2 and all(len(r["ttft_on_sessions_s"]) == 2 for r in rows)
    # the cache emptied before each cached session: its turn 1 misses both times, its later turns hit
    assert rows[0]["cached_tokens_sessions"] == [0, 0]
    assert all(n > 0 for r in rows[1:] for n in r["cached_tokens_sessions"]), rows
    assert len(rows) == 3 and all(r["identical"] for r in rows), rows
    assert rows[0]["cached_tokens"] == 0 and all(r["cached_tokens"] > 0 for r in rows[1:]), rows
    assert report["mode"] == "ddtree" and report["prefix_cache_entries"] > 0 and report["prefill_chunk"] == 32
    miss, hits = rows[0], rows[1:]
    # a miss: the uncached forwards (32-token chunks, cut before each of the 3 message headers past position 0)
    assert miss["chunks_on"] == miss["chunks_off"] > -(-miss["prompt_tokens"] // 32)
    assert miss["restore_s"] == 0 and miss["restored_bytes"] == 0 and miss["snapshots"] > 0
    previous = rows[0]
    for r in hits:  # a hit: from the previous turn's assistant header on, only the answer and the new question
        assert previous["prompt_tokens"] - 16 <= r["cached_tokens"] < previous["prompt_tokens"], (previous, r)
        assert r["chunks_on"] < r["chunks_off"], r
        assert r["restore_s"] > 0 and r["restored_bytes"] > 0, r
        previous = r
    for r in rows:
        assert 0 < r["forwards_on_s"] <= r["ttft_on_s"] and 0 < r["forwards_off_s"] <= r["ttft_off_s"], r
        # the cached run's chunks cover the prompt past the restored prefix, none longer than a prefill chunk
        assert len(r["chunk_tokens_on"]) == r["chunks_on"], r
        assert sum(r["chunk_tokens_on"]) == r["prompt_tokens"] - r["cached_tokens"], r
        assert all(0 < n <= 32 for n in r["chunk_tokens_on"]), r
        assert r["snapshot_s"] > 0
        assert r["copied_bytes"] == r["restored_bytes"] + r["snapshot_bytes"] + r["spilled_bytes"]
    assert report["prefix_cache_device_bytes"] == report["prefix_cache_bytes"]  # within the default device budget
