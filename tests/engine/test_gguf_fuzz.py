"""Corrupted GGUF files (flipped bytes, truncations, hostile metadata values) end in one FlashtreeError or load:
never another exception, never a hang or a runaway allocation. FLASHTREE_FUZZ_VARIANTS sets how many are tried."""

import os
import random
import signal
from contextlib import contextmanager

import pytest
from gguf import GGUFReader

import flashtree.models.gguf_writer as gguf_writer
from flashtree.cli.main import main
from flashtree.engine.loader import load_target
from flashtree.errors import FlashtreeError
from flashtree.models.synthetic import tiny_config, write_synthetic_gguf

VARIANTS = int(os.environ.get("FLASHTREE_FUZZ_VARIANTS", "200"))
SECONDS_PER_VARIANT = 10
HOSTILE_NUMBERS = (0, 1, 3, 7, 2**31 - 1, 2**32 - 1, -1, -(2**31))
NUMERIC_KEYS = ("block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
                "attention.head_count_kv", "attention.key_length", "attention.value_length", "rope.dimension_count",
                "ssm.conv_kernel", "ssm.state_size", "ssm.group_count", "ssm.time_step_rank", "nextn_predict_layers",
                "full_attention_interval")


class Hang(Exception):
    pass


@contextmanager
def time_limit(seconds: int):
    def expire(*_):
        raise Hang(f"no answer within {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _edited(path, edits: dict, monkeypatch):
    """The synthetic model written with `edits` over its qwen35 metadata (None drops a key)."""
    written = gguf_writer.config_metadata

    def config_metadata(config):
        merged = {**written(config), **edits}
        return {key: value for key, value in merged.items() if value is not None}

    with monkeypatch.context() as patch:
        patch.setattr(gguf_writer, "config_metadata", config_metadata)
        return write_synthetic_gguf(path, config=tiny_config(num_layers=2, recurrent_layers=(True, False)))


def _variants(base: bytes, header_end: int, rng: random.Random):
    """(name, bytes or metadata edits) for byte flips in the header and metadata, truncations, and edits."""
    for index in range(VARIANTS):
        kind = index % 5
        if kind in (0, 1):  # the header, metadata and tensor table are where parsing can go wrong
            data = bytearray(base)
            for _ in range(rng.randint(1, 3)):
                data[rng.randrange(header_end)] ^= rng.randint(1, 255)
            yield f"flip-{index}", bytes(data)
        elif kind == 2:
            yield f"truncate-{index}", base[: rng.randrange(len(base))]
        else:
            key = rng.choice(NUMERIC_KEYS)
            edits = {key: rng.choice(HOSTILE_NUMBERS)}
            if key == "full_attention_interval" or rng.random() < 0.3:
                edits["attention.recurrent_layers"] = None  # the interval is read only without the layer list
            yield f"edit-{index}-{key}", edits


def test_corrupted_files_fail_in_one_line_or_load(tmp_path, monkeypatch, capsys):
    base_path = _edited(tmp_path / "base.gguf", {}, monkeypatch)
    base = base_path.read_bytes()
    header_end = GGUFReader(base_path).data_offset
    outcomes = {"loaded": 0, "error": 0}
    for name, variant in _variants(base, header_end, random.Random(25)):
        path = tmp_path / f"{name}.gguf"
        if isinstance(variant, bytes):
            path.write_bytes(variant)
        else:
            _edited(path, variant, monkeypatch)
        with time_limit(SECONDS_PER_VARIANT):
            try:
                load_target(path, device="cpu")
                outcomes["loaded"] += 1
                # what loads must also run: the tokenizer and chat template are read on first use
                assert main(["run", "hi", "-m", str(path), "--device", "cpu", "-n", "2", "--json"]) in (0, 1), name
            except FlashtreeError as exc:
                assert "\n" not in str(exc), name
                outcomes["error"] += 1
            assert main(["info", str(path)]) in (0, 1), name
        path.unlink()
    capsys.readouterr()
    print(f"{VARIANTS} variants: {outcomes}")
    assert outcomes["error"] > VARIANTS // 2  # the corruptions are mostly caught, not silently loaded


@pytest.mark.parametrize("edits,message", [
    ({"full_attention_interval": 0, "attention.recurrent_layers": None}, r"full_attention_interval must be .* \[1,"),
    ({"block_count": 2**31 - 1}, r"block_count must be an integer in \[1, 4096\], got 2147483647"),
    ({"block_count": 3}, "block_count is 3 but the file has tensors for 2 blocks"),
    ({"attention.head_count": 3}, "head_count 3 is not a multiple of head_count_kv 2"),
    ({"nextn_predict_layers": 2}, r"nextn_predict_layers must be an integer in \[0, 1\]"),
    ({"attention.key_length": -1}, "key_length must be"),
])
def test_hostile_metadata_is_named(tmp_path, monkeypatch, edits, message):
    path = _edited(tmp_path / "edited.gguf", edits, monkeypatch)
    with time_limit(SECONDS_PER_VARIANT), pytest.raises(FlashtreeError, match=message):
        load_target(path, device="cpu")


def test_a_string_that_is_not_utf8_is_named(tmp_path, monkeypatch):
    data = _edited(tmp_path / "base.gguf", {}, monkeypatch).read_bytes()
    path = tmp_path / "flipped.gguf"
    path.write_bytes(data.replace(b"<|im_end|>", b"<|im_\xffnd|>", 1))  # inside tokenizer.ggml.tokens
    with pytest.raises(FlashtreeError, match="not a readable GGUF file .*utf-8"):
        load_target(path, device="cpu")
    assert main(["info", str(path)]) == 1
