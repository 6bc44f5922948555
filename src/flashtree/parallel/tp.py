"""Tensor parallel for the qwen35 target through torch.distributed: one process per device (NCCL on GPUs,
gloo on CPU), Megatron-style sharding of the existing model in place, layer by layer at load: the loader
(flashtree.engine.loader) reads each layer as for one process and `RankShard` cuts it to the rank's share.

Per layer and rank (W ranks):
  - gated attention: whole query heads (with their output gates) and whole KV heads, H/W and Hkv/W each
    (contiguous chunks, so query head h keeps its GQA KV head h // group); attn_output row-parallel.
  - Gated DeltaNet: whole q/k heads Hk/W, plus every value head that reads them. In the GGUF's tiled order
    value head h reads q/k head h % Hk, so rank r gets q/k heads j in [r Hk/W, (r+1) Hk/W) and value heads
    t Hk + j for every repeat t, ordered t-major so that the local rule "value head h reads q/k head
    h % (Hk/W)" holds; qkv, conv, z, beta, alpha, A, dt_bias are split the same way, ssm_out row-parallel.
  - MLP: gate/up column-parallel, down row-parallel.
Each row-parallel linear ends in one all_reduce (two per layer). The LM head is vocab-parallel: every rank
computes its slice of the vocabulary and an all_gather assembles the logits on every rank. The embedding,
the norms and the draft are replicated. The cache holds only the rank's heads (the model's config is the
rank-local one). On a GPU the shards stay quantized: rows and whole
blocks of columns of the GGUF blocks, selected as stored; a row-parallel shard whose head runs split a
block (e.g. 128-value DeltaNet heads in 256-value K-quant blocks) is dequantized to the compute dtype.

Ranks stay in lock step by running the same engine code on the same inputs: rank 0 serves requests
through `TensorParallelEngine`, which broadcasts each request (and, once per emitted token, the
cancellation flag) to the followers running `follow`. Sampling seeds are pinned by rank 0, so every
rank draws the same tokens.
"""

from __future__ import annotations

import atexit
import os
import random
import sys
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from flashtree.parallel import CHILD_ENV
from flashtree.errors import FlashtreeError
from flashtree.formats.quants import GGML_QUANT_SIZES
from flashtree.kernels.quant_matmul import QuantWeight
from flashtree.models.deltanet import GatedDeltaNet
from flashtree.models.layers import Linear, Projections, QuantLinear, dense_weight_dtype


class _AllReduced:
    """Mixin: the linear's output summed over the ranks (its input features are split)."""

    group = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = super().__call__(x)
        dist.all_reduce(y, group=self.group)
        return y


class RowParallelLinear(_AllReduced, Linear):
    """x_shard W_shard^T summed over the ranks (input features split, output complete), dense weight."""


class RowParallelQuantLinear(_AllReduced, QuantLinear):
    """The same with the shard's GGUF blocks kept quantized on the GPU."""


def row_parallel(linear: Linear | QuantLinear, group=None):
    """`linear` (a rank's column shard) as a row-parallel linear of its own kind."""
    kind = RowParallelQuantLinear if isinstance(linear, QuantLinear) else RowParallelLinear
    out = kind.__new__(kind)
    out.__dict__.update(vars(linear))
    out.group = group
    return out


class VocabParallelHead:
    """Rows [r V', (r+1) V') of the LM head (V' = ceil(V / W), the last shard zero-padded): the rank's
    slice of the logits, then an all_gather."""

    def __init__(self, inner: Linear | QuantLinear, vocab: int, group=None):
        self.inner, self.vocab, self.group = inner, vocab, group

    @property
    def device(self) -> torch.device:
        return self.inner.device

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes

    def to(self, device) -> "VocabParallelHead":
        self.inner = self.inner.to(device)
        return self

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        part = self.inner(x).contiguous()
        parts = [torch.empty_like(part) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, part, group=self.group)
        return torch.cat(parts, dim=-1)[..., : self.vocab]


def local_config(config, world: int):
    """The rank's share of the heads and of the MLP; refuses shapes that do not split into whole heads."""
    c = config
    need = {"attention heads": c.num_heads, "attention KV heads": c.num_kv_heads,
            "DeltaNet q/k heads": c.gdn_qk_heads, "MLP width": c.intermediate_size}
    bad = [f"{name} {n}" for name, n in need.items() if n % world]
    if bad:
        raise FlashtreeError(f"tensor parallel {world} needs every head count divisible by {world}: "
                             f"{', '.join(bad)} are not (KV-head replication is not implemented)")
    return replace(c, num_heads=c.num_heads // world, num_kv_heads=c.num_kv_heads // world,
                   gdn_qk_heads=c.gdn_qk_heads // world, gdn_v_heads=c.gdn_v_heads // world,
                   intermediate_size=c.intermediate_size // world)


def deltanet_heads(config, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q/k heads, value heads) of `rank`, value heads in local tiled order (t-major)."""
    hk, hv = config.gdn_qk_heads, config.gdn_v_heads
    local = hk // world
    qk = torch.arange(rank * local, (rank + 1) * local)
    v = torch.cat([t * hk + qk for t in range(hv // hk)])
    return qk, v


def _rows(weight: torch.Tensor, heads: torch.Tensor, size: int) -> torch.Tensor:
    """Rows of the given heads (each head `size` consecutive rows), in the given order."""
    return weight.index_select(0, _index(heads, size).to(weight.device)).contiguous()


def _index(heads: torch.Tensor, size: int) -> torch.Tensor:
    return (heads[:, None] * size + torch.arange(size)[None]).reshape(-1)


def shard(linear: Linear | QuantLinear, heads: torch.Tensor, size: int, dim: int,
          dtype: torch.dtype = torch.bfloat16) -> Linear | QuantLinear:
    """The output rows (dim 0) or input columns (dim 1) of the given heads, each `size` consecutive ones,
    in the given order. A QuantLinear stays quantized -- its GGUF blocks selected as stored, bit for bit --
    where every selected run of columns is made of whole blocks; otherwise the dense sub-matrix (in
    `dtype`, the model's dtype, for a QuantLinear: `dense_weight_dtype`). The shard keeps the matmul's
    input rounding (`rounded_input`)."""
    index = _index(heads, size)
    if isinstance(linear, QuantLinear):
        quant = _select_blocks(linear.quant, index, dim)
        if quant is not None:
            return QuantLinear(quant, linear.rounded_input)
        linear = Linear(linear.quant.dequantize(dense_weight_dtype(dtype, linear.device)), linear.rounded_input)
    weight = linear.weight
    return Linear(weight.index_select(dim, index.to(weight.device)).contiguous(), linear.rounded_input)


def _select_blocks(quant: QuantWeight, index: torch.Tensor, dim: int) -> QuantWeight | None:
    block, type_size = GGML_QUANT_SIZES[quant.qtype]
    n, k = quant.shape
    blocks = quant.gguf_bytes().view(n, k // block, type_size)
    if dim == 0:
        return QuantWeight.from_gguf_bytes(blocks[index.to(blocks.device)].reshape(-1), quant.qtype, (len(index), k))
    if len(index) % block:
        return None
    runs = index.view(-1, block)
    if not bool(((runs[:, 0] % block == 0) & (runs == runs[:, :1] + torch.arange(block)).all(1)).all()):
        return None
    picked = blocks[:, (runs[:, 0] // block).to(blocks.device)]
    return QuantWeight.from_gguf_bytes(picked.reshape(-1), quant.qtype, (n, len(index)))


def _chunk(n: int, rank: int, world: int) -> torch.Tensor:
    return torch.arange(rank * n // world, (rank + 1) * n // world)


def shard_layer(layer, full, local, rank: int, world: int, group=None, dtype: torch.dtype = torch.bfloat16) -> None:
    """Replace a DecoderLayer's weights with this rank's shard (in place; `dtype`: the compute dtype of
    any shard that cannot stay quantized)."""

    m = layer.mixer
    if isinstance(m, GatedDeltaNet):
        qk, v = deltanet_heads(full, rank, world)
        dh, hk = full.gdn_head_dim, full.gdn_qk_heads
        # conv channels: [q heads | k heads | v heads], dh channels each
        conv_heads = torch.cat([qk, hk + qk, 2 * hk + v])
        qkv, z, beta, alpha = m.inputs.linears
        m.inputs = Projections.separate([shard(qkv, conv_heads, dh, 0, dtype), shard(z, v, dh, 0, dtype),
                                         shard(beta, v, 1, 0, dtype), shard(alpha, v, 1, 0, dtype)])
        m.conv_weight = _rows(m.conv_weight, conv_heads, dh)
        m.decay_rate, m.dt_bias = m.decay_rate[v].contiguous(), m.dt_bias[v].contiguous()
        m.out = row_parallel(shard(m.out, v, dh, 1, dtype), group)
    else:
        heads, kv = _chunk(full.num_heads, rank, world), _chunk(full.num_kv_heads, rank, world)
        hd = full.head_dim
        q, k, v = m.inputs.linears
        m.inputs = Projections.separate([shard(q, heads, 2 * hd, 0, dtype),  # per head: [query ; gate]
                                         shard(k, kv, hd, 0, dtype), shard(v, kv, hd, 0, dtype)])
        m.out = row_parallel(shard(m.out, heads, hd, 1, dtype), group)
    m.config = local
    mlp, cols = layer.mlp, _chunk(full.intermediate_size, rank, world)
    gate, up = mlp.inputs.linears
    mlp.inputs = Projections.separate([shard(gate, cols, 1, 0, dtype), shard(up, cols, 1, 0, dtype)])
    mlp.down = row_parallel(shard(mlp.down, cols, 1, 1, dtype), group)


def shard_head(head: Linear | QuantLinear, vocab: int, rank: int, world: int, group=None,
               dtype: torch.dtype = torch.bfloat16) -> VocabParallelHead:
    per = -(-vocab // world)
    rows = torch.arange(rank * per, min((rank + 1) * per, vocab))
    part = shard(head, rows, 1, 0, dtype)
    missing = per - len(rows)
    if missing:  # zero rows: zero bytes decode to zero in every GGUF type (zero scales)
        if isinstance(part, QuantLinear):
            zeros = torch.zeros(missing, part.quant.gguf_bytes().shape[1], dtype=torch.uint8, device=part.device)
            raw = torch.cat([part.quant.gguf_bytes(), zeros]).reshape(-1)
            part = QuantLinear(QuantWeight.from_gguf_bytes(raw, part.quant.qtype, (per, part.quant.shape[1])),
                               part.rounded_input)
        else:
            part = Linear(torch.cat([part.weight, part.weight.new_zeros(missing, part.weight.shape[1])]),
                          part.rounded_input)
    return VocabParallelHead(part, vocab, group)


@dataclass(frozen=True)
class RankShard:
    """This rank's share of the target, as `Qwen35Model.load` takes it (its `shard`): the loader reads each
    layer and the LM head on `device` -- on a GPU still as GGUF blocks, so the shards stay quantized
    (`shard`), where host copies would be dense -- and cuts them here; the model gets the rank's config."""

    rank: int
    world: int
    device: torch.device
    group: object = None  # the process group; None: the default one

    def local_config(self, config):
        return local_config(config, self.world)

    def layer(self, layer, full, local, dtype: torch.dtype) -> None:
        shard_layer(layer, full, local, self.rank, self.world, self.group, dtype)

    def head(self, head: Linear | QuantLinear, vocab: int, dtype: torch.dtype) -> VocabParallelHead:
        return shard_head(head, vocab, self.rank, self.world, self.group, dtype)


def check_placement(world: int, gpus: int | None = None, layer_split=None, draft_device=None) -> None:
    """Tensor parallel over `world` ranks refuses the other placements, before anything is loaded."""
    if world > 1 and (gpus not in (None, 1) or layer_split is not None or draft_device is not None):
        raise FlashtreeError("--tensor-parallel does not combine with --gpus / --layer-split / --draft-device "
                             "(each rank keeps a replica of the draft on its own GPU)")


# ---- process group and launch ----

def rank_device(device: str | None = None) -> torch.device:
    """This rank's device: cuda:LOCAL_RANK when CUDA is there and `device` (auto, cuda) allows it, else the CPU."""
    if torch.cuda.is_available() and (device in (None, "auto") or str(device).startswith("cuda")):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def join_group(world: int, device: str | None = None) -> RankShard:
    """Join the process group described by torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT,
    LOCAL_RANK) -- NCCL with one GPU per process, gloo on CPU -- unless already joined, check that it has
    `world` ranks, and return this rank's shard."""
    os.environ.update({k: os.environ.get(k, v) for k, v in CHILD_ENV.items()})
    dev = rank_device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            raise FlashtreeError("tensor parallel needs one process per rank: start with "
                                 "`flashtree ... --tensor-parallel N` or under torchrun")
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    if dist.get_world_size() != world:
        raise FlashtreeError(f"--tensor-parallel {world} but the process group has {dist.get_world_size()} ranks")
    return RankShard(dist.get_rank(), world, dev)


# ---- keeping the ranks in lock step ----

def _broadcast(obj):
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _synced_cancel(cancelled, device):
    """A `cancelled` callback every rank polls at the same points; rank 0's answer is broadcast."""
    def poll() -> bool:
        flag = torch.tensor([bool(cancelled()) if cancelled is not None else False], dtype=torch.int32,
                            device=device)
        dist.broadcast(flag, src=0)
        return bool(flag.item())

    return poll


def _pin_seed(config):
    s = config.sampling
    if s.seed is None and not s.greedy:
        return replace(config, sampling=replace(s, seed=random.getrandbits(63)))
    return config


class TensorParallelEngine:
    """Rank 0's engine: `generate` first broadcasts the request so that every rank runs it too."""

    def __init__(self, engine):
        object.__setattr__(self, "engine", engine)
        object.__setattr__(self, "_open", True)

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def __setattr__(self, name, value):
        """Settings go to the wrapped engine (requests carry their full config to the followers). A prefix
        cache would let rank 0 skip forwards the followers still run, so it stays off for now."""
        if name == "prefix_cache" and value is not None:
            print("flashtree: the prefix cache is off under tensor parallel (not yet kept in step across ranks)",
                  file=sys.stderr)
            value = None
        setattr(self.engine, name, value)

    def generate(self, prompt_ids, config, on_text=None, cancelled=None, on_logprobs=None):
        config = _pin_seed(config)
        _broadcast(("generate", list(prompt_ids), config))
        poll = _synced_cancel(cancelled, self.engine.target.model.device)
        return self.engine.generate(prompt_ids, config, on_text, poll, on_logprobs)

    def shutdown(self) -> None:
        """Release the followers (they exit) and leave the process group; registered atexit."""
        if self._open and dist.is_initialized():
            object.__setattr__(self, "_open", False)
            _broadcast(("stop",))
            dist.destroy_process_group()


def follow(engine) -> None:
    """A follower rank's loop: run every request rank 0 broadcasts, until it says stop."""
    while True:
        try:
            message = _broadcast(None)
        except Exception:  # rank 0 ended without saying stop (killed, or its server re-raised SIGTERM)
            print(f"flashtree rank {dist.get_rank()}: rank 0 is gone, exiting", file=sys.stderr)
            return
        if message[0] == "stop":
            return
        _, prompt_ids, config = message
        try:
            engine.generate(prompt_ids, config, None, _synced_cancel(None, engine.target.model.device))
        except FlashtreeError:
            pass  # rank 0 raised the same error for the same request


def serve_ranks(engine):
    """Called by `load_engine` under tensor parallel: rank 0 gets its engine back (wrapped), the other
    ranks follow rank 0's requests and exit when it is done."""
    if dist.get_rank() == 0:
        wrapped = TensorParallelEngine(engine)
        atexit.register(wrapped.shutdown)
        return wrapped
    sys.stdout = open(os.devnull, "w")  # followers print nothing (gpt-fast does the same)
    follow(engine)
    try:
        dist.destroy_process_group()
    except Exception:
        pass  # the group is already broken when rank 0 died
    sys.exit(0)
