"""The whole process on a GPU (issue #20): sizes, the CUDA context in the plan and the load-time check, the
`--gpu-memory` cap, and the measurement of what lies outside PyTorch's allocator."""

import json

import pytest
import torch

from flashtree.bench import steps
from flashtree.cli.args import engine_args
from flashtree.cli.main import build_parser, main
from flashtree.engine import loader
from flashtree.engine.config import DEFAULT_CUDA_OVERHEAD, EngineArgs
from flashtree.engine.memory_check import check_memory
from flashtree.engine.planner import (CUDA_OVERHEAD_LINE, PlanRequest, parse_size, per_device, per_rank, plan,
                                      target_from_preset)
from flashtree.engine.process_memory import allocator_fraction, cap_process_memory, measure_process_memory
from flashtree.errors import FlashtreeError
from flashtree.models.synthetic import tiny_config

GIB = 2**30
LONG_27B = ["plan", "--synthetic", "qwen3.6-27b", "--ctx", "262144", "-ctk", "tq3_0", "-ctv", "tq3_0"]


@pytest.mark.parametrize("text, size", [("24GiB", 24 * GIB), ("24G", 24 * GIB), ("24", 24 * GIB), ("24 GiB", 24 * GIB),
                                        ("23.5GiB", int(23.5 * GIB)), ("24000MiB", 24000 * 2**20),
                                        ("24GB", 24 * 10**9), ("512mb", 512 * 10**6), ("4096B", 4096),
                                        (".5g", GIB // 2)])
def test_sizes_that_parse(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["lots", "", "GiB", "24Gi", "24iB", "24XB", "-1GiB", "1e3", "24 G iB", "2.4.1G"])
def test_sizes_that_are_refused_with_examples(text):
    with pytest.raises(FlashtreeError, match=r"cannot read memory size .*; write e\.g\. 24GiB, 23\.5GiB, 24000MiB"):
        parse_size(text)


def _request(**kw) -> PlanRequest:
    config, weights, embed, dense, draft, layers = target_from_preset("qwen3.6-27b")
    return PlanRequest(config, weights, embed, draft, 262144, "tq3_0", "tq3_0", dense_params=dense, layer_bytes=layers,
                       **kw)


def test_the_plan_counts_the_cuda_context_on_every_gpu():
    with_context, without = plan(_request()), plan(_request(cuda_overhead=0))
    assert with_context.bytes_of(CUDA_OVERHEAD_LINE) == DEFAULT_CUDA_OVERHEAD
    assert with_context.total - without.total == DEFAULT_CUDA_OVERHEAD
    split = per_device(with_context, [32, 32], draft_device=2)  # two GPUs of layers and a third for the draft
    assert [share[CUDA_OVERHEAD_LINE] for share in split] == [DEFAULT_CUDA_OVERHEAD] * 3
    assert per_rank(with_context, 2)[CUDA_OVERHEAD_LINE] == DEFAULT_CUDA_OVERHEAD
    with pytest.raises(FlashtreeError, match="cuda_overhead must be >= 0"):
        _request(cuda_overhead=-1)


def test_plan_fits_exactly_at_the_cap_and_not_a_byte_below(capsys):
    total = plan(_request()).total
    assert main(LONG_27B + ["--gpu-memory", f"{total}B", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["fits"] and report["total"] == report["available"] == total
    assert report["lines"][CUDA_OVERHEAD_LINE] == report["cuda_overhead"] == DEFAULT_CUDA_OVERHEAD
    assert main(LONG_27B + ["--gpu-memory", f"{total - 1}B"]) == 1
    assert "CUDA context + libraries 0.80 GiB" in capsys.readouterr().err
    # the overhead moves the boundary: measured lower, the same configuration fits one byte less
    lower = ["--cuda-overhead", f"{DEFAULT_CUDA_OVERHEAD - 1}B", "--gpu-memory", f"{total - 1}B"]
    assert main(LONG_27B + lower) == 0


def test_load_time_check_counts_the_cuda_context(make_gguf):
    path = make_gguf("memcheck", config=tiny_config(num_layers=4, gdn_v_heads=4))
    args = dict(draft=None, target_devices=[torch.device("cuda:0")], split=None, draft_device=None, ctx=1024,
                budget=22, cache_type_k=None, cache_type_v=None, gpu_memory="1GiB")
    check_memory(path, **args)  # the tiny model and the default overhead fit in 1 GiB
    with pytest.raises(FlashtreeError, match=r"cuda:0 needs .*CUDA context \+ libraries 1.00 GiB"):
        check_memory(path, **args, cuda_overhead=GIB)


def test_allocator_fraction_leaves_the_overhead_out_of_the_cap():
    assert allocator_fraction(24 * GIB, GIB, 96 * GIB, "cuda:0") == pytest.approx(23 / 96)
    assert allocator_fraction(96 * GIB, 0, 96 * GIB, "cuda:0") == 1.0
    with pytest.raises(FlashtreeError, match=r"--gpu-memory 97.00 GiB is more than cuda:0 has \(96.00 GiB\)"):
        allocator_fraction(97 * GIB, GIB, 96 * GIB, "cuda:0")
    with pytest.raises(FlashtreeError, match="leaves nothing for tensors .* 1.00 GiB \\(--cuda-overhead\\)"):
        allocator_fraction(GIB, GIB, 96 * GIB, "cuda:0")


def test_cap_is_set_once_per_cuda_device(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: type("P", (), {"total_memory": 96 * GIB}))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, device: calls.append((f, device)))
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", lambda conf: None)
    cap_process_memory(["cuda", torch.device("cuda:0"), "cuda:1", "cpu"], "24GiB", GIB)
    assert sorted(calls, key=lambda c: c[1].index) == [(23 / 96, torch.device("cuda:0")),
                                                       (23 / 96, torch.device("cuda:1"))]
    calls.clear()
    cap_process_memory(["cuda:0"], None, GIB)  # no --gpu-memory: no cap
    assert calls == []


@pytest.mark.parametrize("user_conf, asked", [(None, ["expandable_segments:True"]),
                                              ("max_split_size_mb:512", ["expandable_segments:True"]),
                                              ("expandable_segments:False", [])])
def test_a_cap_grows_segments_in_place_unless_the_user_chose(monkeypatch, user_conf, asked):
    settings = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: type("P", (), {"total_memory": 96 * GIB}))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, device: None)
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", settings.append)
    if user_conf is None:
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    else:
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", user_conf)
    cap_process_memory(["cuda:0"], "24GiB", GIB)
    assert settings == asked
    settings.clear()
    cap_process_memory(["cpu"], "24GiB", GIB)  # no CUDA device: the allocator is left alone
    cap_process_memory(["cuda:0"], None, GIB)
    assert settings == []


def test_gpu_memory_flags_reach_the_engine_and_its_cap(monkeypatch):
    args = build_parser().parse_args(["run", "hi", "--gpu-memory", "24GiB", "--cuda-overhead", "600MiB"])
    settings = engine_args(args, device="cpu", spec="ar")
    assert (settings.gpu_memory, settings.cuda_overhead) == ("24GiB", 600 * 2**20)
    assert engine_args(build_parser().parse_args(["run", "hi"])).cuda_overhead == DEFAULT_CUDA_OVERHEAD
    capped = []
    monkeypatch.setattr(loader, "cap_process_memory", lambda *a: capped.append(a))
    loader.load_engine(settings)
    assert capped == [([torch.device("cpu")], "24GiB", 600 * 2**20)]  # a CPU device: cap_process_memory skips it
    with pytest.raises(FlashtreeError, match="cuda_overhead must be >= 0"):
        EngineArgs(cuda_overhead=-1)


def _fake_device(monkeypatch, free: int, total: int, reserved: int, peak_reserved: int, peak_allocated: int):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: peak_reserved)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: peak_allocated)


def test_measurement_splits_the_device_into_allocator_and_the_rest(monkeypatch):
    _fake_device(monkeypatch, free=100 * GIB, total=140 * GIB, reserved=39 * GIB + GIB // 2,
                 peak_reserved=40 * GIB, peak_allocated=38 * GIB)
    m = measure_process_memory(0)
    assert m.device_used == 40 * GIB and m.outside_allocator == GIB // 2
    assert m.peak_footprint == 40 * GIB + GIB // 2
    assert m.as_gib() == {"device_used": 40.0, "allocator_reserved": 39.5, "outside_allocator": 0.5,
                          "allocator_peak_allocated": 38.0, "allocator_peak_reserved": 40.0, "peak_footprint": 40.5}


def test_bench_reports_the_process_next_to_the_allocator_peak(monkeypatch, capsys):
    _fake_device(monkeypatch, free=100 * GIB, total=140 * GIB, reserved=39 * GIB, peak_reserved=40 * GIB,
                 peak_allocated=38 * GIB)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    report = steps.cuda_memory_report()
    assert report["peak_memory_GiB"] == {"cuda:0": 38.0}
    assert report["process_memory_GiB"]["cuda:0"]["outside_allocator"] == 1.0
    assert report["process_memory_GiB"]["cuda:0"]["peak_footprint"] == 41.0
    steps._print({"context_prefill": {"tokens": 8, "s": 1.0, "tok_s": 8.0}, "peak_memory_by_phase_GiB": {},
                  "outside_allocator_by_phase_GiB": {"context prefill": 1.0},
                  "footprint_by_phase_GiB": {"context prefill": 41.0}, **report})
    printed = capsys.readouterr().out
    assert "process on cuda:0: peak footprint 41.0 GiB = allocator peak reserved 40.0 + outside the allocator 1.0" \
        in printed
    assert "outside the allocator after each phase: {'context prefill': 1.0}" in printed
    assert "process footprint so far after each phase: {'context prefill': 41.0}" in printed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cap_and_measurement_on_a_gpu():
    device = torch.device("cuda", torch.cuda.current_device())
    torch.matmul(torch.ones(64, 64, device=device), torch.ones(64, 64, device=device))  # cuBLAS loaded
    m = measure_process_memory(device)
    assert m.outside_allocator > 0 and m.device_used >= m.allocator_reserved  # the CUDA context at least
    torch.cuda.empty_cache()  # no cached block of earlier tests to serve the allocation below the cap
    try:
        cap_process_memory([device], "2GiB", GIB)  # 1 GiB for tensors
        with pytest.raises(torch.cuda.OutOfMemoryError):
            torch.empty(3 * GIB // 2, dtype=torch.uint8, device=device)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
