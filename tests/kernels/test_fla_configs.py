"""kernels/fla_configs: fla's tuned configurations written in its file format, and read back only where
they were shipped for the GPU at hand and the user has not chosen otherwise."""

import hashlib
import json
import types
from dataclasses import dataclass, field

import pytest

from flashtree.kernels import fla_configs


@dataclass
class FakeConfig:  # the triton.Config fields fla's files keep
    kwargs: dict
    num_warps: int
    num_stages: int = 2
    num_ctas: int = 1
    maxnreg: int | None = None


@dataclass
class FakeTuner:  # an fla autotuner after a run: its kernel's name and the configuration chosen per key
    kernel_name: str
    cache: dict = field(default_factory=dict)


def test_gpu_names_become_fla_directory_names():
    assert fla_configs.gpu_directory_name("NVIDIA H200") == "NVIDIA_H200"
    assert fla_configs.gpu_directory_name("NVIDIA GeForce RTX 4090 (laptop)") == "NVIDIA_GeForce_RTX_4090_laptop"
    assert fla_configs.gpu_directory_name("??") == "unknown_gpu"


def test_written_files_hold_every_key_and_the_most_chosen_default(tmp_path):
    fast, slow = FakeConfig({"BK": 64}, 4), FakeConfig({"BK": 32}, 2, num_stages=3)
    tuner = FakeTuner("chunk_kernel", {(32, 48, 128, "torch.bfloat16"): fast, (32, 48, 128, "torch.float32"): slow,
                                       (16, 48, 128, "torch.bfloat16"): fast})
    [path] = fla_configs.write_tuned(tmp_path / "NVIDIA_H200", [tuner])
    data = json.loads(path.read_text())
    assert path.name == "chunk_kernel.json" and data["kernel_name"] == "chunk_kernel"
    assert len(data["autotune_entries"]) == 3
    key = [32, 48, 128, "torch.float32"]
    digest = hashlib.md5(json.dumps(key, separators=(",", ":"), sort_keys=True).encode()).hexdigest()
    entry = data["autotune_entries"][digest]  # fla looks an exact key up by this hash
    assert entry["autotune_key"] == key
    assert entry["config"] == {"kwargs": {"BK": 32}, "num_warps": 2, "num_stages": 3, "num_ctas": 1, "maxnreg": None}
    assert data["default_config"]["kwargs"] == {"BK": 64}


def test_fla_reads_the_written_files(tmp_path):
    cache = pytest.importorskip("fla.ops.utils.cache")  # fla-core: the gpu extra
    tuner = FakeTuner("chunk_kernel", {(32, 48, "torch.bfloat16"): FakeConfig({"BK": 64}, 4)})
    [path] = fla_configs.write_tuned(tmp_path, [tuner])
    parsed = cache.KernelConfigFile.from_file(path)
    assert parsed is not None
    assert parsed.lookup_exact(cache.AutotuneKey((32, 48, "torch.bfloat16")))["config"]["kwargs"] == {"BK": 64}
    assert parsed.lookup_fuzzy(cache.AutotuneKey((64, 48, "torch.bfloat16"))) is not None


@pytest.mark.parametrize("gpu", ["NVIDIA_H200", "NVIDIA_H100_80GB_HBM3"])
def test_the_shipped_files_parse_and_hold_the_prefill_kernels(gpu):
    """What tools/gpu/extract_fla_configs.py wrote on an H200 (2026-12-01) and an H100 (2026-12-06): fla's file
    format, one file per chunked gated-delta kernel, each with its configuration for the 27B shape's heads."""
    files = sorted((fla_configs.SHIPPED / gpu).glob("*.json"))
    assert {p.stem for p in files} == {"chunk_fwd_kernel_o", "chunk_gated_delta_rule_fwd_kernel_h_blockdim64",
                                       "chunk_gated_delta_rule_fwd_kkt_solve_kernel",
                                       "chunk_local_cumsum_scalar_kernel", "recompute_w_u_fwd_kernel"}
    for path in files:
        content = json.loads(path.read_text())
        assert content["kernel_name"] == path.stem and content["autotune_entries"] and content["default_config"]
    try:
        from fla.ops.utils.cache import KernelConfigFile  # fla-core (the gpu extra) reads them as well
    except ImportError:
        return
    assert all(KernelConfigFile.from_file(path) is not None for path in files)


@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.delenv("FLA_CACHE_MODE", raising=False)
    monkeypatch.delenv("FLA_CONFIG_DIR", raising=False)
    monkeypatch.setattr(fla_configs.torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    return monkeypatch


def test_shipped_configs_are_used_for_their_gpu_only(clean_env, tmp_path):
    assert fla_configs.use_shipped("cuda:0", tmp_path) is None  # nothing shipped for this GPU: fla autotunes
    assert "FLA_CACHE_MODE" not in fla_configs.os.environ
    (tmp_path / "NVIDIA_H200").mkdir()
    assert fla_configs.use_shipped("cuda:0", tmp_path) == tmp_path / "NVIDIA_H200"
    assert fla_configs.os.environ["FLA_CACHE_MODE"] == "fuzzy"
    assert fla_configs.os.environ["FLA_CONFIG_DIR"] == str(tmp_path / "NVIDIA_H200")


def test_a_users_own_setting_wins(clean_env, tmp_path):
    (tmp_path / "NVIDIA_H200").mkdir()
    clean_env.setenv("FLA_CACHE_MODE", "disabled")
    assert fla_configs.use_shipped("cuda:0", tmp_path) is None
    assert fla_configs.os.environ["FLA_CACHE_MODE"] == "disabled" and "FLA_CONFIG_DIR" not in fla_configs.os.environ


def test_tuned_kernels_are_found_under_their_decorators(monkeypatch):
    """fla's kernels are module attributes, an autotuner often wrapped by @triton.heuristics: found through
    `.fn`; untuned ones are left out."""
    autotuner = pytest.importorskip("triton.runtime.autotuner")

    class Tuned(autotuner.Autotuner):
        def __init__(self, cache):  # no kernel behind it: only what the scan reads
            self.cache, self.kernel_name = cache, "k"

    tuned, untuned = Tuned({(1,): FakeConfig({}, 4)}), Tuned({})
    module = types.ModuleType("fla.ops.fake")
    module.wrapped = types.SimpleNamespace(fn=tuned)  # what @triton.heuristics leaves at module level
    module.bare, module.idle = tuned, untuned
    monkeypatch.setitem(fla_configs.sys.modules, "fla.ops.fake", module)
    assert fla_configs.tuned_autotuners() == [tuned]
