import torch

from flashtree.cli.threads import default_threads, physical_cores, set_threads


def test_default_is_omp_num_threads_when_set(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert default_threads() == 3


def test_default_leaves_one_physical_core(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert default_threads() == max(physical_cores() - 1, 1)


def test_physical_cores_fit_the_affinity_mask():
    import os

    assert 1 <= physical_cores() <= len(os.sched_getaffinity(0))


def test_set_threads_sets_torch_and_returns_the_count():
    before = torch.get_num_threads()
    try:
        assert set_threads(2) == 2 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
