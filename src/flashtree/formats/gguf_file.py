"""A GGUF file opened for inference: metadata as Python values, a tensor table, memory-mapped bytes.

Parsing is the `gguf` package's; this module turns its failures into one-line errors that name the
file and the problem, and checks what the reader leaves unchecked (truncated tensor data).
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

from flashtree.errors import FlashtreeError
from flashtree.formats.quants import bytes_for, dequantize

GGUF_MAGIC = b"GGUF"
_ROWS_PER_CHECK = 1024  # rows dequantized at a time by non_finite_tensors: bounded memory for any tensor


@dataclass(frozen=True)
class TensorInfo:
    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # torch order: last dimension is the contiguous one
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class GGUFFile:
    """Read-only view of one GGUF file. Tensor bytes stay on disk until asked for."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self._check_header()
        try:  # everything the reader parses, decodes or sizes: a corrupt byte anywhere fails here
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self._reader = GGUFReader(self.path, mode="r")
            self.metadata: dict[str, Any] = {
                name: _field_value(field) for name, field in self._reader.fields.items() if not name.startswith("GGUF.")
            }
            self.tensors: dict[str, TensorInfo] = {t.name: _tensor_info(t) for t in self._reader.tensors}
        except (ValueError, IndexError, KeyError, OSError, OverflowError, MemoryError) as exc:
            # UnicodeDecodeError (a flipped byte in a string) is a ValueError
            raise FlashtreeError(f"{self.path}: not a readable GGUF file ({_short(exc)}); the file may be truncated "
                                 f"or corrupt") from exc
        self._check_tensor_data_present()

    def _check_header(self) -> None:
        if not self.path.is_file():
            raise FlashtreeError(f"{self.path}: no such file")
        with open(self.path, "rb") as fh:
            magic = fh.read(4)
        if magic != GGUF_MAGIC:
            raise FlashtreeError(f"{self.path}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")

    def _check_tensor_data_present(self) -> None:
        size = self.path.stat().st_size
        for info in self.tensors.values():
            if info.offset + info.nbytes > size:
                raise FlashtreeError(
                    f"{self.path}: truncated: tensor {info.name} ends at byte {info.offset + info.nbytes} "
                    f"but the file has {size} bytes; download it again"
                )

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise FlashtreeError(f"{self.path}: metadata key {key!r} is missing")
        return self.metadata[key]

    def raw(self, name: str) -> torch.Tensor:
        """The tensor's bytes as a uint8 tensor backed by the memory map (no copy)."""
        info = self.tensor(name)
        view = self._reader.data[info.offset : info.offset + info.nbytes]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the map is read-only; we never write through it
            return torch.from_numpy(view)

    def non_finite_tensors(self) -> list[str]:
        """Tensors whose values are not all finite once decoded (a NaN or inf block scale shows up here). Reads
        every weight: seconds for a small model, minutes for a large one."""
        return [info.name for info in self.tensors.values() if not self._finite(info)]

    def _finite(self, info: TensorInfo) -> bool:
        cols = info.shape[-1] if info.shape else 1
        row_bytes = bytes_for(info.qtype, (cols,))
        raw = self.raw(info.name)
        for start in range(0, info.numel // cols, _ROWS_PER_CHECK):
            rows = raw[start * row_bytes : (start + _ROWS_PER_CHECK) * row_bytes]
            if not dequantize(rows, info.qtype, (rows.numel() // row_bytes, cols)).isfinite().all():
                return False
        return True

    def tensor(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise FlashtreeError(f"{self.path}: tensor {name!r} is missing")
        return self.tensors[name]


def _short(exc: Exception) -> str:
    """The exception's first line, cut to a length an error line can carry."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text if len(text) <= 200 else text[:200] + "..."


def _field_value(field) -> Any:
    value = field.contents()
    if isinstance(value, np.generic):
        return value.item()
    return value


def _tensor_info(t) -> TensorInfo:
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    block, type_size = GGML_QUANT_SIZES[t.tensor_type]
    nbytes = math.prod(shape) * type_size // block  # Python ints: corrupt dimensions cannot wrap around
    return TensorInfo(t.name, GGMLQuantizationType(t.tensor_type), shape, int(t.data_offset), nbytes)
