"""Write a qwen35 GGUF from float tensors (in GGUF layout) with a chosen quant type per tensor.

Used by tests to make synthetic models in the real format, and by training to export its models.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType

from flashtree.formats.quants import quantize
from flashtree.formats.tokenizer import TokenizerSpec
from flashtree.models.qwen35_config import ARCH, Qwen35Config

_PLAIN = {QType.F32: np.float32, QType.F16: np.float16}


def config_metadata(config: Qwen35Config) -> dict[str, object]:
    """The `qwen35.*` keys a converter writes for this config (block_count includes MTP layers)."""
    c = config
    return {
        "block_count": c.num_layers + c.num_mtp_layers,
        "context_length": c.context_length,
        "embedding_length": c.hidden_size,
        "feed_forward_length": c.intermediate_size,
        "attention.head_count": c.num_heads,
        "attention.head_count_kv": c.num_kv_heads,
        "attention.key_length": c.head_dim,
        "attention.value_length": c.head_dim,
        "attention.layer_norm_rms_epsilon": c.rms_eps,
        "rope.dimension_count": c.rope_dim,
        "rope.freq_base": c.rope_theta,
        "rope.dimension_sections": [11, 11, 10, 0],
        "ssm.conv_kernel": c.conv_kernel,
        "ssm.state_size": c.gdn_head_dim,
        "ssm.group_count": c.gdn_qk_heads,
        "ssm.time_step_rank": c.gdn_v_heads,
        "ssm.inner_size": c.gdn_value_dim,
        "attention.recurrent_layers": list(c.recurrent_layers) + [False] * c.num_mtp_layers,
        "nextn_predict_layers": c.num_mtp_layers,
    }


def write_qwen35_gguf(path: str | Path, config: Qwen35Config, tensors: Mapping[str, np.ndarray],
                      qtypes: Mapping[str, QType] | None = None, tokenizer: TokenizerSpec | None = None) -> Path:
    """`tensors` are float arrays in torch shape ([out, in]), or uint8 arrays already packed in their
    `qtypes` entry ([rows, bytes per row]); `qtypes` defaults to F32 for every tensor."""
    path = Path(path)
    qtypes = qtypes or {}
    writer = gguf.GGUFWriter(str(path), arch=ARCH)
    writer.add_name(config.name)
    for key, value in config_metadata(config).items():
        _add_value(writer, f"{ARCH}.{key}", value)
    if tokenizer is not None:
        for key, value in tokenizer.to_metadata().items():
            _add_value(writer, key, value)
    for name, array in tensors.items():
        qtype = qtypes.get(name, QType.F32)
        if array.dtype == np.uint8:
            writer.add_tensor(name, array, raw_dtype=qtype)
            continue
        array = np.ascontiguousarray(array, dtype=np.float32)
        if qtype in _PLAIN:
            writer.add_tensor(name, array.astype(_PLAIN[qtype]))
        else:
            packed = quantize(array.reshape(-1, array.shape[-1]), qtype)
            writer.add_tensor(name, packed.reshape(*array.shape[:-1], -1), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_value(writer: gguf.GGUFWriter, key: str, value: object) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value) if value >= 0 else writer.add_int32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, (list, tuple)):
        writer.add_array(key, list(value))
    else:
        raise TypeError(f"cannot write metadata {key} of type {type(value).__name__}")
