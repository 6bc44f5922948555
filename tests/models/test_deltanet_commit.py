"""The commit of a verified path on the GPU path's dispatch: every DeltaNet layer's state in one `fold_layers` launch
and its conv window in one `shift_windows_together` launch where the verify left its u, Gamma, k and conv inputs in
the cache's `FoldBuffers`, else one `fold_path` and one `shift_window` a layer. The kernels
themselves are checked in tests/kernels (interpreter cases and the GPU test); here they are recorded, not run."""

import torch

from flashtree.kernels import gated_delta_triton
from flashtree.kernels.gated_delta_triton import FOLD_ROWS
from flashtree.models import deltanet
from flashtree.models.cache import TargetCache, TreeScratch
from flashtree.models.synthetic import tiny_config


def scratch(t: int, u: torch.Tensor, gamma: torch.Tensor, conv: torch.Tensor | None = None) -> TreeScratch:
    return TreeScratch(torch.zeros(t, 8) if conv is None else conv, torch.zeros(t, 1), u, gamma)


def commit_calls(monkeypatch, cache: TargetCache, scratches: list[TreeScratch]) -> list[str]:
    calls = []
    monkeypatch.setattr(deltanet, "triton_runs_on", lambda device: True)
    monkeypatch.setattr(deltanet, "shift_window", lambda *args: calls.append("window"))
    monkeypatch.setattr(deltanet, "shift_windows_together", lambda table, *args: calls.append(f"windows {len(table.windows)}"))
    monkeypatch.setattr(gated_delta_triton, "fold_layers", lambda tables, *args: calls.append(f"layers {len(tables.states)}"))
    monkeypatch.setattr(gated_delta_triton, "fold_path", lambda *args: calls.append("path"))
    layers = [(None, cache.deltanet[i], s) for i, s in zip(sorted(cache.deltanet), scratches)]
    cpu = torch.device("cpu")
    deltanet.commit_layers(layers, torch.tensor([0, 1]), torch.tensor([2]), cache.fold_tables.get(cpu),
                           cache.window_tables.get(cpu))
    return calls


def test_one_launch_commits_every_layer_the_verify_left_in_the_fold_buffers(monkeypatch):
    config = tiny_config(num_layers=4)
    cache = TargetCache.allocate(config, 32, "cpu", torch.float32)
    indices = sorted(cache.deltanet)
    heads, dk, dv = cache.deltanet[indices[0]].ssm.shape
    buffers = [cache.fold_buffers(i, 2, dk) for i in indices]
    # made for every layer at the first call, for trees of up to FOLD_ROWS nodes, and listed in layer order
    assert set(cache.fold) == set(indices) and cache.fold_buffers(indices[-1], 2, dk) is buffers[-1]
    assert buffers[0].u.shape == (FOLD_ROWS, heads, dv) and buffers[0].k.shape == (FOLD_ROWS, 2, dk)
    assert buffers[0].takes(FOLD_ROWS) and not buffers[0].takes(FOLD_ROWS + 1)
    tables = cache.fold_tables[torch.device("cpu")]
    assert [t.data_ptr() for t in tables.states] == [cache.deltanet[i].ssm.data_ptr() for i in indices]
    assert tables.addresses.tolist()[1] == [b.u.data_ptr() for b in buffers]
    windows = cache.window_tables[torch.device("cpu")]
    assert [w.data_ptr() for w in windows.windows] == [cache.deltanet[i].conv.data_ptr() for i in indices]
    conv = cache.deltanet[indices[0]].conv
    assert buffers[0].conv.shape == (FOLD_ROWS, conv.shape[1]) and buffers[0].conv.dtype == conv.dtype
    assert windows.addresses.tolist()[1] == [b.conv.data_ptr() for b in buffers]

    t, n = 5, len(indices)
    verified = [scratch(t, b.u[:t], b.gamma[:t], b.conv[:t]) for b in buffers]
    assert commit_calls(monkeypatch, cache, verified) == [f"windows {n}", f"layers {n}"]
    # a layer whose verify took another path (its u and inputs elsewhere): every layer is committed on its own
    verified[1] = scratch(t, torch.zeros(t, heads, dv), torch.zeros(t, heads))
    assert commit_calls(monkeypatch, cache, verified) == ["window"] * n + ["path"] * n


def test_without_fold_buffers_each_layer_is_folded_on_its_own(monkeypatch):
    cache = TargetCache.allocate(tiny_config(num_layers=4), 32, "cpu", torch.float32)
    heads, _, dv = next(iter(cache.deltanet.values())).ssm.shape
    scratches = [scratch(3, torch.zeros(3, heads, dv), torch.zeros(3, heads)) for _ in cache.deltanet]
    assert commit_calls(monkeypatch, cache, scratches) == ["window"] * len(cache.deltanet) + ["path"] * len(cache.deltanet)
