"""engine/memory_check + planner.refusal: the plan is checked per GPU before any weight is loaded."""

import pytest
import torch

from flashtree.cli.main import main
from flashtree.engine.memory_check import check_memory, check_rank_memory
from flashtree.engine.planner import PREFIX_CACHE_LINE, PlanRequest, per_device, plan, refusal, target_from_preset
from flashtree.errors import FlashtreeError
from flashtree.models.synthetic import tiny_config

GIB = 2**30


def test_refusal_names_each_device_that_does_not_fit():
    config, weights, embed, dense, draft, layers = target_from_preset("qwen3.6-27b")
    result = plan(PlanRequest(config, weights, embed, draft, 65536, "f16", "f16", dense_params=dense, layer_bytes=layers))
    assert refusal(result, [64], 0, [20 * GIB], ["cuda:0"]).startswith("does not fit: ctx 65536 with K f16 / V f16: cuda:0 needs")
    assert refusal(result, [64], 0, [40 * GIB], ["cuda:0"]) is None
    # the draft on a second GPU: only that one is short
    message = refusal(result, [64], 1, [40 * GIB, 2 * GIB], ["cuda:0", "cuda:1"])
    assert "cuda:1 needs" in message and "cuda:0" not in message.split("cuda:1")[0]
    assert "--layer-split" in message and "flashtree plan" in message


def test_check_memory_before_loading(make_gguf):
    path = make_gguf("memcheck", config=tiny_config(num_layers=4, gdn_v_heads=4))
    args = dict(draft=None, split=None, draft_device=None, ctx=1024, budget=22, cache_type_k=None, cache_type_v=None)
    with pytest.raises(FlashtreeError, match=r"cuda:0 needs .* of 1.0 MiB.*memory from --gpu-memory"):
        check_memory(path, target_devices=[torch.device("cuda:0")], gpu_memory="1MiB", **args)
    check_memory(path, target_devices=[torch.device("cuda:0")], gpu_memory="1GiB", **args)
    split = {**args, "split": [1.0, 1.0]}  # a two-GPU split of a 4-layer model, each share checked
    with pytest.raises(FlashtreeError, match="cuda:1 needs"):
        check_memory(path, target_devices=[torch.device("cuda:0"), torch.device("cuda:1")], gpu_memory="1KiB", **split)
    check_memory(path, target_devices=[torch.device("cpu")], gpu_memory="1KiB", **args)  # CPU: not budgeted


def test_cli_refuses_before_loading(make_gguf, capsys):
    if not torch.cuda.is_available():  # --gpu-memory budgets GPUs; on the CPU the run goes ahead
        path = str(make_gguf("memcheck", config=tiny_config(num_layers=4, gdn_v_heads=4)))
        assert main(["run", "hi", "-m", path, "--device", "cpu", "-n", "2", "--gpu-memory", "1KiB", "--raw"]) == 0
        return
    path = str(make_gguf("memcheck", config=tiny_config(num_layers=4, gdn_v_heads=4)))
    assert main(["run", "hi", "-m", path, "--device", "cuda", "-n", "2", "--gpu-memory", "1KiB"]) == 1
    assert "does not fit" in capsys.readouterr().err


def test_tensor_parallel_rank_checks_its_share(make_gguf):
    path = make_gguf("memcheck", config=tiny_config(num_layers=4, gdn_v_heads=4))
    args = dict(draft=None, world=2, ctx=1024, budget=22, cache_type_k=None, cache_type_v=None)
    with pytest.raises(FlashtreeError, match=r"one rank of tensor parallel 2 needs .* on cuda:1 but 0.0 MiB is available \(--gpu-memory"):
        check_rank_memory(path, device=torch.device("cuda:1"), gpu_memory="1KiB", **args)
    check_rank_memory(path, device=torch.device("cuda:1"), gpu_memory="1GiB", **args)
    check_rank_memory(path, device=torch.device("cpu"), gpu_memory="1KiB", **args)  # CPU ranks: not budgeted


def test_the_prefix_cache_device_budget_is_checked_and_split_with_the_deltanet_layers(make_gguf):
    path = make_gguf("memcheck", config=tiny_config(num_layers=4, gdn_v_heads=4))
    args = dict(draft=None, split=None, draft_device=None, ctx=1024, budget=22, cache_type_k=None, cache_type_v=None,
                gpu_memory="1GiB")
    check_memory(path, target_devices=[torch.device("cuda:0")], **args)
    with pytest.raises(FlashtreeError, match="cuda:0 needs"):  # 2 GiB of snapshots do not fit a 1 GiB card
        check_memory(path, target_devices=[torch.device("cuda:0")], prefix_cache_device_bytes=2 * GIB, **args)
    config, weights, embed, dense, draft, layers = target_from_preset("qwen3.6-27b")
    result = plan(PlanRequest(config, weights, embed, draft, 4096, "bf16", "bf16", dense_params=dense,
                              layer_bytes=layers, prefix_cache_device_bytes=4 * GIB))
    shares = [device[PREFIX_CACHE_LINE] for device in per_device(result, [32, 32])]
    assert shares[0] == shares[1] and 0 <= 4 * GIB - sum(shares) < 48  # 24 DeltaNet layers on each half (whole bytes)
