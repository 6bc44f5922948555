"""On a machine with two CUDA devices: every placement emits the single-GPU greedy tokens."""

import pytest
import torch

from flashtree.engine.config import EngineArgs, GenerationConfig
from flashtree.engine.loader import load_engine
from flashtree.models.synthetic import tiny_config
from tests.drafting.test_lossless import random_draft

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]

PROMPTS = [[3, 17, 99, 250, 8], [400, 2, 2, 71, 5, 33, 120, 9, 61]]
PLACEMENTS = {"layer split": {"layer_split": "1,1"}, "draft on cuda:1": {"draft_device": "cuda:1"},
              "both": {"layer_split": "1,3", "draft_device": "cuda:1"}}


@pytest.fixture(scope="module")
def files(make_gguf, tmp_path_factory):
    from flashtree.engine.loader import load_target

    gguf = make_gguf("multi-gpu", config=tiny_config(num_layers=4, gdn_v_heads=4))
    draft_dir = tmp_path_factory.mktemp("draft")
    random_draft(load_target(gguf, device="cpu")).save(draft_dir)
    return gguf, draft_dir


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
@pytest.mark.parametrize("mode", ["ar", "ddtree"])
def test_placement_matches_one_gpu(files, placement, mode):
    gguf, draft_dir = files
    config = GenerationConfig(max_new_tokens=40, mode=mode, ignore_eos=True)

    def run(**options):
        # split targets run eagerly: compare the same kernels
        engine = load_engine(EngineArgs(gguf, draft_dir, device="cuda", enforce_eager=True, **options))
        return [engine.generate(p, config).token_ids for p in PROMPTS]

    assert run(**PLACEMENTS[placement]) == run()
