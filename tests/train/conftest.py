import os

# Once the tokenizers thread pool has run, it competes with torch's CPU threads (training steps slow 100x).
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import json as _json  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from flashtree.train.corpus import build_corpus  # noqa: E402
from flashtree.train.target import TINY_SHAPE, TrainConfig, train_target  # noqa: E402

SOURCE_DIR = Path(_json.__file__).parent  # the stdlib json package: small, always there


@pytest.fixture(scope="session")
def tiny_corpus():
    return build_corpus(roots=[SOURCE_DIR], max_chars=None)


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory, tiny_corpus):
    """A tiny qwen35 target trained for a few steps, exported as F32 (exact) GGUF."""
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("target")
    train = TrainConfig(steps=4, batch_size=2, seq_len=32, log_every=0)
    return train_target(out, TINY_SHAPE, train, "cpu", corpus=tiny_corpus, scheme="f32", log=lambda m: None)
