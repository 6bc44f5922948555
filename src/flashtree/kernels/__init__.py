"""Kernels: one family per module, each a Triton GPU kernel with a torch reference of the same signature.

Where a Triton kernel runs: on CUDA tensors, and on CPU tensors under Triton's interpreter
(TRITON_INTERPRET=1, set before triton is imported), which is how the tests exercise them without a GPU.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_runs_on(device: torch.device | str) -> bool:
    return triton_installed() and (torch.device(device).type == "cuda" or interpreted())
