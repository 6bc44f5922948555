import os

import pytest
import torch

# The test models are tiny: intra-op threads only add contention (50x slower on a busy 2-core machine).
# OMP_NUM_THREADS is also what `flashtree.cli.main` falls back to, so the CLI tests keep 1 thread too.
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)

from flashtree.models.synthetic import synthetic_tokenizer, write_synthetic_gguf


@pytest.fixture(scope="session")
def tokenizer_spec():
    return synthetic_tokenizer()


@pytest.fixture(scope="session")
def make_gguf(tmp_path_factory, tokenizer_spec):
    """make_gguf(name, **kwargs) -> path of a synthetic qwen35 GGUF, written once per session and name."""
    made = {}

    def make(name: str = "tiny", **kwargs):
        if name not in made:
            path = tmp_path_factory.mktemp("gguf") / f"{name}.gguf"
            made[name] = write_synthetic_gguf(path, tokenizer=kwargs.pop("tokenizer", tokenizer_spec), **kwargs)
        return made[name]

    return make
