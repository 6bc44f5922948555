"""The small speculative target and its random draft that the prefix-cache tests share (a module that
needs another target defines its own `target`, which takes precedence over these)."""

import pytest

from flashtree.engine.loader import load_target
from flashtree.models.synthetic import tiny_config
from tests.drafting.test_lossless import random_draft


@pytest.fixture(scope="module")
def target(make_gguf):
    return load_target(make_gguf("spec", config=tiny_config(num_layers=4, gdn_v_heads=4)), device="cpu")


@pytest.fixture(scope="module")
def draft(target):
    return random_draft(target)
