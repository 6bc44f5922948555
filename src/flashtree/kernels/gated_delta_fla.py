"""Chunked (prefill) gated delta rule on the GPU through fla-core's Triton kernels.

fla-core implements exactly this recurrence (the `gated_delta.chunked` reference: S <- exp(g) S;
u = beta (v - S^T k); S <- S + k u^T; o = S^T q) with fused chunk-parallel kernels, which a long
prompt needs: the torch reference launches ~15 kernels per 64-token chunk and layer. Our q arrives
L2-normalised and already scaled, so fla's own scaling is turned off (scale=1); q and k are passed
expanded to the value heads, so fla's grouped head mapping never applies and the GGUF's tiled order
(v head h uses q/k head h % Hk) is kept. Optional: without fla-core (or off CUDA) callers use the
torch reference.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import sys

import torch

from flashtree.kernels import fla_configs


@functools.cache
def available() -> bool:
    return importlib.util.find_spec("fla") is not None


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same signature and result as `gated_delta.chunked` (q, k, v [T, H, d]; g, beta [T, H];
    state [H, dk, dv], not modified): (o [T, H, dv] float32, final state float32)."""
    _shipped_configs(q.device)  # before fla's first import, which reads the setting
    o, final = _chunk_kernel()(q[None], k[None], v[None], g[None], beta[None], scale=1.0,
                                      initial_state=state[None].float(), output_final_state=True)
    return o[0].float(), final[0].float()


@functools.cache
def _shipped_configs(device: torch.device) -> None:
    """Once per device: fla reads the launch configurations shipped for this GPU model instead of
    autotuning them (`fla_configs.use_shipped`)."""
    fla_configs.use_shipped(device)


# fla's package __init__s import every layer, model and op of the library, and a torch.compile decorator among
# them imports TorchInductor: 5-6 s of a cold start's first prefill on the H200 host (2026-12-02, tools/gpu/
# cold_start.py --profile), against ~0.2 s for the modules the chunked kernel itself imports
FLA_BARE_PACKAGES = ("fla", "fla.ops", "fla.modules")


@functools.cache
def _chunk_kernel():
    """fla's `chunk_gated_delta_rule` (optional: the gpu extra, fla-core), imported without running the
    FLA_BARE_PACKAGES' __init__s (`import_without_package_inits`). A library importing fla later in the process
    sees the bare packages: transformers' Qwen3.5 (bench --peers) then takes its own torch gated delta rule."""
    try:
        attributes = {"fla": {"__version__": importlib.metadata.version("fla-core")}}  # fla.utils reads it
    except importlib.metadata.PackageNotFoundError:  # fla without its metadata: the bare import fails, the plain one runs
        attributes = {}
    return import_without_package_inits("fla.ops.gated_delta_rule", FLA_BARE_PACKAGES, attributes).chunk_gated_delta_rule


def import_without_package_inits(name: str, packages: tuple[str, ...], attributes: dict[str, dict]):
    """Import module `name` with `packages` (outermost first) registered as bare packages whose __init__ does not
    run, each given `attributes[package]` that its submodules read from it; falls back to the plain import (and
    says so on stderr) where the module needs more of them, as another version of the library may."""
    if not any(package in sys.modules for package in packages):
        try:
            for package in packages:
                bare = importlib.util.module_from_spec(importlib.util.find_spec(package))
                vars(bare).update(attributes.get(package, {}))
                sys.modules[package] = bare
                parent, _, child = package.rpartition(".")
                if parent:
                    setattr(sys.modules[parent], child, bare)
            return importlib.import_module(name)
        except (ImportError, AttributeError) as exc:
            print(f"flashtree: importing {name} in full ({exc})", file=sys.stderr)
            root = packages[0]
            for loaded in [m for m in sys.modules if m == root or m.startswith(root + ".")]:
                del sys.modules[loaded]
    return importlib.import_module(name)
