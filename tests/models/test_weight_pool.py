"""`WeightPool`: a model piece built apart from its temporaries keeps its values, its views and nothing in the
scratch pool."""

from collections import namedtuple
from dataclasses import dataclass

import pytest
import torch

from flashtree.engine.loader import random_target
from flashtree.models import weight_pool
from flashtree.models.weight_pool import WeightPool, relocate

Pair = namedtuple("Pair", "first second")


@dataclass(frozen=True)
class Frozen:
    raw: torch.Tensor


class Holder:  # a flashtree object (this module's name starts with neither: see `relocate`)
    pass


Holder.__module__ = "flashtree.tests.holder"


def test_relocate_copies_every_reachable_tensor_and_keeps_views_of_one_storage():
    base = torch.arange(12.0)
    holder = Holder()
    holder.base, holder.view = base, base[2:8].reshape(2, 3)
    holder.items = [Frozen(torch.ones(3)), (torch.zeros(2), 7), Pair(torch.full((2,), 5.0), "x")]
    holder.table = {"p": torch.nn.Parameter(torch.ones(2), requires_grad=False)}
    holder.again = holder  # cycles end
    before = {name: getattr(holder, name).clone() for name in ("base", "view")}
    relocate(holder, lambda t: True)
    assert holder.base.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    assert torch.equal(holder.base, before["base"]) and torch.equal(holder.view, before["view"])
    # the view still views the copied base: one storage, the same offset and strides
    assert holder.view.untyped_storage().data_ptr() == holder.base.untyped_storage().data_ptr()
    assert holder.view.storage_offset() == 2 and holder.view.stride() == (3, 1)
    frozen, plain, pair = holder.items
    assert torch.equal(frozen.raw, torch.ones(3)) and isinstance(pair, Pair) and pair.second == "x"
    assert plain[1] == 7 and torch.equal(pair.first, torch.full((2,), 5.0))
    assert isinstance(holder.table["p"], torch.nn.Parameter) and not holder.table["p"].requires_grad


def test_relocate_leaves_tensors_the_predicate_keeps():
    holder = Holder()
    kept = holder.kept = torch.ones(4)
    relocate(holder, lambda t: False)
    assert holder.kept is kept


def test_on_the_cpu_the_pool_just_builds():
    pool = WeightPool(torch.device("cpu"))
    assert pool.scratch is None and pool.build(lambda: 42) == 42
    pool.close()


def test_a_torch_whose_pools_refuse_expandable_segments_builds_plainly(monkeypatch):
    """torch 2.7-2.8 raise inside `use_mem_pool` under expandable segments: the piece is built again without the
    pool, and so are the next ones; any other error (an out-of-memory above all) goes on up."""
    import contextlib

    @contextlib.contextmanager
    def refusing(pool, device=None):
        raise RuntimeError("MemPool doesn't currently support expandable_segments.")
        yield

    monkeypatch.setattr(torch.cuda, "use_mem_pool", refusing, raising=False)
    pool = WeightPool(torch.device("cpu"))
    pool.scratch = object()  # as on a GPU
    assert pool.build(lambda: "built") == "built" and pool.scratch is None

    @contextlib.contextmanager
    def out_of_memory(pool, device=None):
        raise torch.OutOfMemoryError("CUDA out of memory. ... PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True ...")
        yield

    monkeypatch.setattr(torch.cuda, "use_mem_pool", out_of_memory, raising=False)
    pool.scratch = object()
    with pytest.raises(torch.OutOfMemoryError):
        pool.build(lambda: "built")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_model_built_apart_has_no_tensor_in_the_scratch_and_the_same_logits(monkeypatch):
    if not hasattr(torch.cuda, "use_mem_pool"):
        pytest.skip("this torch has no torch.cuda.use_mem_pool")
    tokens = torch.tensor([3, 17, 5, 9, 2, 11])
    target = random_target("tiny", scheme="q4_k_m", device="cuda", dtype=torch.bfloat16, seed=3)
    model = target.model
    default_pool = {(s["address"], s["address"] + s["total_size"]) for s in torch.cuda.memory_snapshot()
                    if tuple(s["segment_pool_id"]) == (0, 0)}
    outside = []

    def note(tensor):
        ptr = tensor.untyped_storage().data_ptr()
        if tensor.is_cuda and not any(lo <= ptr < hi for lo, hi in default_pool):
            outside.append(tuple(tensor.shape))
        return False

    relocate(model.layers, note)
    relocate(model.lm_head, note)
    assert not outside, f"tensors left outside the default pool: {outside[:5]}"
    logits = model.forward(tokens, model.new_cache(16)).logits

    monkeypatch.setattr(weight_pool.WeightPool, "build", lambda self, make: make())
    plain = random_target("tiny", scheme="q4_k_m", device="cuda", dtype=torch.bfloat16, seed=3).model
    assert torch.equal(logits, plain.forward(tokens, plain.new_cache(16)).logits)
