"""A qwen35 GGUF's model config and tokenizer spec, read from its metadata and tensor table (no weights), and
the check that every tensor the trunk uses has a supported quant type."""

from __future__ import annotations

from flashtree.errors import FlashtreeError
from flashtree.formats.gguf_file import GGUFFile
from flashtree.formats.quants import SUPPORTED_TYPES, type_name
from flashtree.formats.tokenizer import TokenizerSpec
from flashtree.models.qwen35_config import Qwen35Config


def read_config(gguf: GGUFFile) -> tuple[Qwen35Config, TokenizerSpec | None]:
    spec = TokenizerSpec.from_metadata(gguf.metadata) if "tokenizer.ggml.tokens" in gguf.metadata else None
    embed = gguf.tensor("token_embd.weight")
    vocab = embed.shape[0]
    config = Qwen35Config.from_metadata(gguf.metadata, vocab_size=vocab, blocks_in_file=_blocks_in_file(gguf))
    if spec is not None and len(spec.tokens) > vocab:
        raise FlashtreeError(f"{gguf.path}: tokenizer has {len(spec.tokens)} tokens but the embedding only {vocab} rows")
    return config, spec


def _blocks_in_file(gguf: GGUFFile) -> int:
    """How many layers (`blk.N.` with N from 0) the tensor table could hold: one past the highest N."""
    indexes = [name.split(".")[1] for name in gguf.tensors if name.startswith("blk.")]
    return 1 + max((int(i) for i in indexes if i.isascii() and i.isdigit()), default=-1)


def check_tensor_types(gguf: GGUFFile, config: Qwen35Config) -> None:
    trunk = tuple(f"blk.{i}." for i in range(config.num_layers))
    for info in gguf.tensors.values():
        used = not info.name.startswith("blk.") or info.name.startswith(trunk)
        if used and info.qtype not in SUPPORTED_TYPES:
            supported = ", ".join(sorted(type_name(t) for t in SUPPORTED_TYPES))
            raise FlashtreeError(
                f"{gguf.path}: tensor {info.name} uses quant type {type_name(info.qtype)}, which flashtree does not "
                f"support yet (supported: {supported})"
            )
