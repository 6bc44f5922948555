"""`flashtree info --check-weights` decodes every weight and names the tensors that are not finite."""

import numpy as np
import pytest

from flashtree.cli.main import main
from flashtree.formats.gguf_file import GGUFFile

TENSOR = "blk.0.ffn_up.weight"


def _poisoned(tmp_path, source, value: bytes):
    """A copy of `source` with the first bytes of TENSOR's data overwritten by `value`."""
    offset = GGUFFile(source).tensor(TENSOR).offset
    data = bytearray(source.read_bytes())
    data[offset : offset + len(value)] = value
    path = tmp_path / "poisoned.gguf"
    path.write_bytes(bytes(data))
    return path


def test_finite_weights_pass(make_gguf, capsys):
    assert main(["info", str(make_gguf()), "--check-weights"]) == 0
    assert "all finite" in capsys.readouterr().out


@pytest.mark.parametrize("scheme,value", [
    ("f32", np.float32(np.inf).tobytes()),
    ("q8_0", np.float16(np.nan).tobytes()),  # a Q8_0 block starts with its fp16 scale
], ids=["f32-inf", "q8_0-nan-scale"])
def test_a_non_finite_weight_or_scale_is_named(tmp_path, make_gguf, capsys, scheme, value):
    path = _poisoned(tmp_path, make_gguf(f"check-{scheme}", scheme=scheme), value)
    assert main(["info", str(path)]) == 0  # without the flag the weights are not read
    capsys.readouterr()
    assert main(["info", str(path), "--check-weights"]) == 1
    assert f"non-finite values (NaN or inf) in 1 tensors: {TENSOR}" in capsys.readouterr().err
