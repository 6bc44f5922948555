"""fla-core's tuned launch configurations, shipped so that a fresh machine does not autotune.

fla autotunes each of its chunked gated-delta kernels on first use (up to 48 configurations each, every one
compiled and timed): most of the minute a fresh H200 spent before the 27B shape's first token (2026-12-01).
fla can instead read the best configuration per kernel from `{kernel}.json` files in a directory
(`FLA_CONFIG_DIR`), when `FLA_CACHE_MODE` asks it to; a key it does not find is autotuned as before.

* `use_shipped(device)`: before fla is imported, point it at `assets/fla-configs/<GPU name>/` when that
  directory exists (files written on that GPU model), unless the user set either variable.
* `write_tuned(directory)`: after a run, the configurations fla's autotuners chose in this process, in fla's
  file format (`tools/gpu/extract_fla_configs.py` runs the 27B prefill shapes and calls it).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from collections import Counter
from pathlib import Path

import torch

SHIPPED = Path(__file__).resolve().parents[1] / "assets" / "fla-configs"
MODE = "fuzzy"  # fla's lookup: the exact key, else one of the same shape (other lengths); else autotune


def gpu_directory_name(gpu_name: str) -> str:
    """The directory fla names a GPU model by (its own sanitising: runs of other characters -> `_`)."""
    return re.sub(r"[^0-9A-Za-z]+", "_", gpu_name).strip("_") or "unknown_gpu"


def use_shipped(device: torch.device, shipped: Path = SHIPPED) -> Path | None:
    """Set FLA_CACHE_MODE / FLA_CONFIG_DIR for `device`'s GPU model when configurations were shipped for it
    and the user set neither; returns the directory used (None: fla autotunes as it would)."""
    if "FLA_CACHE_MODE" in os.environ or "FLA_CONFIG_DIR" in os.environ:
        return None
    directory = shipped / gpu_directory_name(torch.cuda.get_device_name(device))
    if not directory.is_dir():
        return None
    os.environ["FLA_CACHE_MODE"], os.environ["FLA_CONFIG_DIR"] = MODE, str(directory)
    return directory


def key_hash(key) -> str:
    """fla's name for an autotune key in its files: md5 of the key as compact, key-sorted JSON."""
    return hashlib.md5(json.dumps(_plain(key), separators=(",", ":"), sort_keys=True).encode()).hexdigest()


def tuned_autotuners() -> list:
    """fla's module-level autotuned kernels loaded in this process that chose at least one configuration."""
    from triton.runtime.autotuner import Autotuner  # where fla runs, triton does

    found = {}
    for name, module in list(sys.modules.items()):
        if name == "fla" or name.startswith("fla."):
            for value in vars(module).values():
                for layer in _decorator_layers(value):  # an autotuner may sit under @triton.heuristics
                    if isinstance(layer, Autotuner) and layer.cache:
                        found[id(layer)] = layer
    return list(found.values())


def _decorator_layers(value, depth: int = 4):
    """`value` and what it wraps (triton's decorators keep the wrapped kernel in `.fn`)."""
    for _ in range(depth):
        yield value
        value = getattr(value, "fn", None)
        if value is None:
            return


def write_tuned(directory: Path, autotuners=None) -> list[Path]:
    """One `{kernel}.json` per tuned kernel in `directory`: every key it tuned, and its most chosen
    configuration as the default. Returns the files written."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for tuner in tuned_autotuners() if autotuners is None else autotuners:
        name = getattr(tuner, "kernel_name", None) or tuner.fn.__name__
        entries = {key_hash(key): {"autotune_key": _plain(key), "config": _config(config)}
                   for key, config in tuner.cache.items()}
        common = Counter(json.dumps(e["config"], sort_keys=True) for e in entries.values()).most_common(1)[0][0]
        path = directory / f"{name}.json"
        path.write_text(json.dumps({"kernel_name": name, "triton_version": _triton_version(),
                                    "autotune_entries": entries, "default_config": json.loads(common)},
                                   indent=1, sort_keys=True))
        written.append(path)
    return written


def _config(config) -> dict:
    """A triton.Config as fla's files hold it."""
    return {"kwargs": dict(config.kwargs), "num_warps": config.num_warps, "num_stages": config.num_stages,
            "num_ctas": getattr(config, "num_ctas", 1), "maxnreg": getattr(config, "maxnreg", None)}


def _plain(key):
    """An autotune key (a tuple of ints, strings, dtypes' names) as JSON values."""
    if isinstance(key, (list, tuple)):
        return [_plain(k) for k in key]
    return key if isinstance(key, (int, float, str, bool)) or key is None else str(key)


def _triton_version() -> str | None:
    module = sys.modules.get("triton")
    return getattr(module, "__version__", None)
