"""Triton kernels compiled ahead of their first launch (kernels/triton_ahead.py)."""

import pytest
import torch

from flashtree.kernels import triton_ahead

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402


def test_the_installed_triton_compiles_through_the_step_this_records():
    """A Triton whose compile step takes other arguments would silently compile nothing ahead: fail here."""
    assert triton_ahead.supported()


def test_recording_keeps_autotuning_out_of_the_disk_cache():
    """Inside `recorded_launches` an autotuner benchmarks its configs (their launches are what is recorded) but
    reads and writes nothing of Triton's on-disk cache, whose choice later processes would take; after it the
    cache step is Triton's again."""
    from triton.runtime.autotuner import Autotuner

    before = Autotuner.check_disk_cache
    benched = []
    with triton_ahead.recorded_launches():
        assert Autotuner.check_disk_cache(None, ("key",), [], lambda: benched.append(1)) is False
    assert benched == [1] and Autotuner.check_disk_cache is before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_autotuned_launch_recorded_writes_no_choice_to_disk_cuda(tmp_path, monkeypatch):
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path))
    tuned = triton.autotune([triton.Config({"BLOCK": 128}), triton.Config({"BLOCK": 256})], key=["n"],
                            cache_results=True)(_add_one_kernel)
    x = torch.zeros(1000, device="cuda")
    with triton_ahead.recorded_launches() as launches:
        tuned[(lambda meta: (triton.cdiv(x.numel(), meta["BLOCK"]),))](x, x.numel())
    assert len(launches) == 2 and not list(tmp_path.rglob("*.autotune.json"))


@triton.jit
def _add_one_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + 1.0, mask=mask)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_recorded_launch_runs_nothing_then_runs_compiled_ahead_cuda():
    x = torch.zeros(1000, device="cuda")
    with triton_ahead.recorded_launches() as launches:
        _add_one_kernel[(4,)](x, x.numel(), BLOCK=256)
        _add_one_kernel[(4,)](x, x.numel(), BLOCK=256)  # the same specialization: recorded once
    torch.cuda.synchronize()
    assert len(launches) == 1 and launches[0].name == "_add_one_kernel"
    assert (x == 0).all()  # nothing ran
    assert triton_ahead.compile_launches(launches) == []
    compiled = []
    triton.knobs.runtime.jit_post_compile_hook = lambda *args, **kwargs: compiled.append(kwargs.get("key"))
    try:
        _add_one_kernel[(4,)](x, x.numel(), BLOCK=256)
    finally:
        triton.knobs.runtime.jit_post_compile_hook = None
    torch.cuda.synchronize()
    assert compiled == []  # the launch found it compiled
    assert (x == 1).all()
