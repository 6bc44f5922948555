"""`flashtree bench --synthetic SHAPE --steps`: the cost of every part of the decode loop at a real
model shape, each held against a floor measured in the same run.

- AR step and tree-verify steps (`--verify-budgets`, by default 15/22/32/64) against the weight-read
  roofline: bytes of the matrices one step reads / read bandwidth measured here (a sum over a large buffer).
- Draft step against the draft's own floor (its weights + the LM head it borrows from the target).
- Host-side tree build, walk and commit.
- Prefill throughput at 1K and 13K prompt tokens; peak GPU memory: the allocator's, and the whole
  process's (the device's used memory, CUDA context and library modules included: engine/process_memory.py),
  also after each phase, so that a run of fewer rows (`--verify-budgets 22 --chunk-lengths none
  --prefill-lengths none`: a context and budget-22 decoding) measures that configuration's footprint alone.
- Replay end to end: the real draft runs every step, but its proposal is replaced by the target's own
  recorded continuation cut so that accepted lengths average --replay-al (the seed reports 5.17); the
  whole loop (draft, tree, verify, walk, commit, rollback of rejected nodes) is timed against AR on the
  same prompt, and the outputs are compared.
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import replace

import torch

from flashtree.bench.memory_snapshot import SnapshotRecorder
from flashtree.bench.profile import kernels_beyond, print_beyond, print_profile, profile_call
from flashtree.bench.report import save_report
from flashtree.parallel.placement import resolve_device
from flashtree.engine.config import DEFAULT_BUDGET, DEFAULT_DRAFT_TYPE, DENSE_DRAFT
from flashtree.engine.process_memory import measure_process_memory
from flashtree.errors import out_of_memory_summary
from flashtree.models.dflash import DFlashDraft, DraftConfig, build_target_layer_ids
from flashtree.models.layers import MATMUL_TYPES
from flashtree.drafting.proposer import DFlashProposer
from flashtree.engine.decode import make_tree, proposer_for, walk


def weight_bytes(model) -> int:
    """Bytes of matrix weights one target step reads (the embedding lookup excluded)."""
    return model.lm_head.nbytes + sum(value.nbytes for layer in model.layers for obj in (layer.mixer, layer.mlp)
                                      for value in vars(obj).values()
                                      if isinstance(value, MATMUL_TYPES))


def read_bandwidth(device: torch.device, gib: float = 4.0) -> float:
    """Bytes per second of a full read of a large buffer (the roofline's denominator)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the CPU sums bf16 slowly
    data = torch.ones(int((gib if device.type == "cuda" else 0.25) * 2**30) // dtype.itemsize, dtype=dtype, device=device)
    return data.numel() * dtype.itemsize / timed(lambda: data.sum(dtype=torch.float32), device, repeat=10)


def timed(fn, device: torch.device, repeat: int = 10, warmup: int = 2) -> float:
    """Median seconds of `fn()` (synchronized)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start = clock(device)
        fn()
        times.append(clock(device) - start)
    return statistics.median(times)


def clock(device: torch.device) -> float:
    """perf_counter once `device` has finished its queued work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def random_draft(target_config, device, dtype, seed: int = 0, draft_type: str = DEFAULT_DRAFT_TYPE) -> DFlashDraft:
    """A random DFlash draft of the published shape for this target size (5 layers, heads of 128 for a
    27B-class target), in `dtype` on `device`, its layer matrices held as `draft_type` (a quantized draft is
    built on the host and its matrices packed on `device` one at a time, as `DFlashDraft.load` does)."""
    c = target_config
    layers = 5 if c.num_layers >= 32 else 2
    head_dim = 128 if c.hidden_size >= 1024 else 16
    heads = max(c.hidden_size // head_dim, 1)
    config = DraftConfig.from_json({
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": max(heads // 4, 1), "head_dim": head_dim,
        "rms_norm_eps": 1e-6, "rope_theta": 1e7, "block_size": 16, "vocab_size": c.vocab_size,
        "num_target_layers": c.num_layers,
        "dflash_config": {"mask_token_id": c.vocab_size - 1,
                          "target_layer_ids": build_target_layer_ids(c.num_layers, layers)}})
    torch.manual_seed(seed)
    # made in `dtype` where it lives, as `DFlashDraft.load` does: built in float32 and cast, the 27B draft's 6.4 GiB
    # float32 copy left the freed blocks it passed through reserved around the bf16 one (issue #20's footprint)
    with torch.device("meta"):
        draft = DFlashDraft(config).to(dtype)
    draft = draft.to_empty(device=device if draft_type == DENSE_DRAFT else "cpu")
    for p in draft.parameters():
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=p.shape[1] ** -0.5)
        else:
            torch.nn.init.ones_(p)
    if draft_type != DENSE_DRAFT:
        draft.quantize_layers(draft_type, device).to(device)
    return draft.eval()


class ReplayProposer:
    """Runs the real draft every step, then replaces its proposal by the recorded continuation: the
    first k positions carry the true tokens (k cycles so that accepted lengths average `al`), position k
    and below never do, so the target rejects there and the loop rolls back."""

    def __init__(self, inner: DFlashProposer, reference: list[int], al: float):
        self.inner, self.reference, self.al = inner, reference, al
        self.block_size, self.capture_layers = inner.block_size, inner.capture_layers
        self.credit = 0.0
        self._nonfinite_rows = 0  # draft rows with inf/NaN logits (reported: the draft's own numerics)
        # the same on the device, for `static_block` inside the engine's one-graph step: the record (padded past
        # its end by one block), the credit and the count of non-finite rows as device state the graph updates
        device = inner.device
        self._reference_t = torch.tensor(reference + reference[-1:] * self.block_size, device=device)
        self._credit_t = torch.zeros(1, device=device, dtype=torch.float64)
        self._nonfinite_t = torch.zeros(1, device=device, dtype=torch.long)

    @property
    def nonfinite_rows(self) -> int:
        return self._nonfinite_rows + int(self._nonfinite_t)

    def start(self) -> None:
        self.inner.start()
        self.credit = 0.0
        self._credit_t.zero_()

    def commit(self, features: torch.Tensor, positions: torch.Tensor) -> None:
        self.inner.commit(features, positions)

    # the inner proposer's static (graph-ready) commit, so the engine commits as with a real draft
    @property
    def steps(self):
        return self.inner.steps

    @property
    def cache(self):
        return self.inner.cache

    def commit_static(self, features: torch.Tensor, positions: torch.Tensor, count: torch.Tensor,
                      offsets: torch.Tensor | None = None) -> None:
        self.inner.commit_static(features, positions, count, offsets)

    def static_block(self, packed: torch.Tensor, rows: int) -> torch.Tensor:
        """`propose` as a function of device inputs [bonus, position, context length] (the inner draft's
        `static_block`), so that the engine runs its whole step as one graph (engine/cuda_graphs.py)."""
        logits = self.inner.static_block(packed, rows)
        self._nonfinite_t += (~torch.isfinite(logits).all(-1)).sum()
        logits = torch.nan_to_num(logits).clamp_(-1e3, 1e3)
        self._credit_t += self.al - 1
        depth = torch.arange(logits.shape[0], device=logits.device)
        correct = torch.clamp(self._credit_t.floor(), max=logits.shape[0])
        self._credit_t -= correct
        truth = self._reference_t[(packed[1] + 1 + depth).clamp_(max=self._reference_t.shape[0] - 1)]
        values = torch.where(depth < correct, 1e4, float("-inf")).to(logits.dtype)
        return logits.scatter_(1, truth[:, None], values[:, None])

    @torch.inference_mode()
    def propose(self, bonus: int, position: int) -> torch.Tensor:
        logits = self.inner.propose(bonus, position)
        self._nonfinite_rows += int((~torch.isfinite(logits).all(-1)).sum())
        # a random draft fed the echo model's large features gives logits far beyond 1e4 (H200, 27B shape:
        # AL 1.0 until these were bounded), and may overflow: bounded values keep the forced ones decisive
        logits = torch.nan_to_num(logits).clamp_(-1e3, 1e3)
        self.credit += self.al - 1
        correct = min(int(self.credit), logits.shape[0])
        self.credit -= correct
        truth = self.reference[position + 1 : position + 1 + logits.shape[0]]
        depth = torch.arange(len(truth))
        tokens = torch.tensor(truth)
        values = torch.where(depth < correct, 1e4, float("-inf"))
        logits[depth.to(logits.device), tokens.to(logits.device)] = values.to(logits.device, logits.dtype)
        return logits


LONG_PREFILL = 32768


def run_steps(args, engine, device_name: str, snapshots: SnapshotRecorder | None = None) -> int:
    """The `--steps` tables; `snapshots` (`--memory-snapshot`, started before the load) reports the allocator's
    memory after each phase and at the end."""
    model = engine.target.model
    device = model.device
    dtype = model.dtype
    _, ranks = _rank_and_world()
    report: dict = {"date": time.strftime("%Y-%m-%d"), "device": device_name, "model": str(engine.target.path),
                    "weights_bytes_per_step": weight_bytes(model),
                    "cuda_graphs": engine.runner.graph_runner() is not None,
                    "tensor_parallel": ranks}
    bandwidth = read_bandwidth(device)
    report["read_bandwidth_GBps"] = round(bandwidth / 1e9, 1)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the probe's buffer out of the allocator's reservation: the process is measured
        report["memory_after_load_GiB"] = round(torch.cuda.memory_allocated(device) / 2**30, 2)
        report["device_used_after_load_GiB"] = measure_process_memory(device).as_gib()["device_used"]
        report["gpu_memory_cap"] = getattr(args, "gpu_memory", None)
        for i in range(torch.cuda.device_count()):  # peaks from here on: not the build's or the probe's buffers
            torch.cuda.reset_peak_memory_stats(i)
        if snapshots is not None:  # the weights alone: what their build left reserved around them
            report["memory_snapshot_by_phase"] = {"load": snapshots.phase("load")}
    roofline_s = report["weights_bytes_per_step"] / bandwidth
    draft_device = resolve_device(args.draft_device) if getattr(args, "draft_device", None) else device
    draft_type = getattr(args, "draft_type", DEFAULT_DRAFT_TYPE)
    draft = (engine.draft if isinstance(engine.draft, DFlashDraft)
             else random_draft(model.config, draft_device, dtype, draft_type=draft_type))
    engine.draft = draft
    draft_bytes = _module_bytes(draft) + model.lm_head.nbytes
    rows = []

    _print_header(report)

    def row(name: str, seconds: float, floor_s: float | None = None, **extra):
        entry = {"step": name, "ms": round(seconds * 1e3, 3), **extra}
        if floor_s:
            entry["floor_ms"] = round(floor_s * 1e3, 3)
            entry["vs_floor"] = round(seconds / floor_s, 2)
        rows.append(entry)
        _print_row(entry)

    def out_of_memory(name: str, exc: torch.OutOfMemoryError) -> None:
        """A row that does not fit (under --gpu-memory: on the card being played) is reported as such, and the
        run goes on to the next row and the memory report."""
        torch.cuda.empty_cache()
        detail = out_of_memory_summary(exc)
        rows.append({"step": name, "error": "out of memory", "detail": detail})
        print(f"{name:<24}{'out of memory':>14}  {detail}", flush=True)

    prompt = _prompt(model.config.vocab_size, args.context)
    # trees on every step (adaptive off): the replay times speculation at its AL, and its record must be verify rows
    config = engine.config_for(mode="ddtree", max_new_tokens=args.max_tokens + 64 * args.repeat, ignore_eos=True,
                               adaptive=False)
    proposer = proposer_for(engine.runner, config)  # as the engine's own loop builds it (graph-ready on CUDA)
    cache = engine.runner.new_cache(len(prompt), config)
    started = clock(device)
    engine.runner.prefill_prompt(cache, prompt, config, proposer)
    seconds = clock(device) - started  # includes the first calls' kernel compiles
    report["context_prefill"] = {"tokens": len(prompt), "s": round(seconds, 3), "tok_s": round(len(prompt) / seconds, 1)}
    peaks = report["peak_memory_by_phase_GiB"] = {}  # the peak so far after each phase (main device)

    outside = report["outside_allocator_by_phase_GiB"] = {}  # what grows outside PyTorch's allocator, and when
    footprint = report["footprint_by_phase_GiB"] = {}  # the allocator's peak reservation so far + outside it now

    def mark(phase: str) -> None:
        if device.type == "cuda":
            peaks[phase] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
            outside[phase] = measure_process_memory(device).as_gib()["outside_allocator"]
            footprint[phase] = round(torch.cuda.max_memory_reserved(device) / 2**30 + outside[phase], 2)
        if snapshots is not None:
            report.setdefault("memory_snapshot_by_phase", {})[phase] = snapshots.phase(phase)

    mark("context prefill")
    token = torch.tensor([prompt[-1]])
    ar = timed(lambda: engine.runner.step_forward(token, cache), device, args.repeat)
    row("ar step", ar, roofline_s, tok_s=round(1 / ar, 1), GBps=round(report["weights_bytes_per_step"] / ar / 1e9, 1))

    bonus = prompt[-1]
    draft_logits = proposer.propose(bonus, cache.length)
    capture = proposer.capture_layers
    for budget in args.verify_budgets:
        tree = make_tree("ddtree", bonus, draft_logits, budget, config.topk)
        try:
            verify = timed(lambda: engine.runner.step_forward(tree.tokens, cache, tree, capture, pad_to=budget + 1),
                           device, args.repeat)
        except torch.OutOfMemoryError as exc:
            out_of_memory(f"verify budget {budget}", exc)
            continue
        row(f"verify budget {budget}", verify, roofline_s, vs_ar=round(verify / ar, 2))
        mark(f"ar and verify up to budget {budget}")
    row("draft step", timed(lambda: proposer.propose(bonus, cache.length), device, args.repeat),
        draft_bytes / bandwidth)
    # the same draft with its layers in Q8_0, reading the same context cache; not under a --gpu-memory cap,
    # where its 1.7 GiB (at 27B) beside the bf16 draft is not part of the configuration being measured, nor
    # when the draft's layers are Q8_0 already (--draft-type q8_0)
    if device.type == "cuda" and not getattr(args, "gpu_memory", None) and draft_type == DENSE_DRAFT:
        q8 = q8_sibling(draft)
        q8_proposer = DFlashProposer(model, q8, config.draft_window, capture_graphs=_captures(engine))
        q8_proposer.cache = proposer.cache
        row("draft step (q8_0)", timed(lambda: q8_proposer.propose(bonus, cache.length), device, args.repeat),
            (_module_bytes(q8) + model.lm_head.nbytes) / bandwidth)
        del q8, q8_proposer
        mark("draft steps (bf16, q8_0 copy)")

    tree = make_tree("ddtree", bonus, draft_logits, DEFAULT_BUDGET, config.topk)
    row(f"tree build (budget {DEFAULT_BUDGET})",
        timed(lambda: make_tree("ddtree", bonus, draft_logits, DEFAULT_BUDGET, config.topk), device, args.repeat))
    result = engine.runner.step_forward(tree.tokens, cache, tree, capture, pad_to=DEFAULT_BUDGET + 1)
    sampler = engine.runner.sampler(prompt, config)
    row("walk", timed(lambda: walk(tree, result.logits, sampler), device, args.repeat))
    row("commit (depth-4 path)", _commit_time(engine, cache, proposer, tree, capture, args.repeat))
    _device_step_rows(engine, cache, proposer, bonus, config.topk, device, args.repeat, ar, rows, row)

    mark("tree, walk, commit")
    _chunk_rows(engine, cache, args.chunk_lengths, device, args.repeat, ar, roofline_s, row)
    for length in args.prefill_lengths:
        if length + 8 > model.config.context_length:
            continue
        ids = _prompt(model.config.vocab_size, length, seed=length)
        fresh = engine.runner.new_cache(length, replace(config, max_new_tokens=8))
        once = length >= LONG_PREFILL  # minutes-long prompts run once (the shorter rows warmed the kernels up)
        try:
            seconds = timed(lambda: _prefill(engine, fresh, ids, args.prefill_chunk), device, repeat=1 if once else 2,
                            warmup=0 if once else 1)
        except torch.OutOfMemoryError as exc:
            out_of_memory(f"prefill {length}", exc)
            continue
        finally:
            del fresh
        row(f"prefill {length}", seconds, tok_s=round(length / seconds, 1))

    mark("prefill rows")
    if args.replay_al > 0:  # 0 skips it (each of its three generations prefills the context again)
        report["replay"] = _replay(engine, draft, prompt, args, config)
        mark("replay")
    if getattr(args, "profile", False):
        # the steps as timed (on CUDA, CUPTI lists a graph replay's kernels one by one); last, since the graph
        # steps timed after such a profile ran up to 2x slower on the H200 (2026-12-01)
        report["profile_ar_step"] = profile_call(lambda: model.forward(token, cache), device)  # one by one
        print_profile("AR step (eager)", report["profile_ar_step"], device)
        if device.type == "cuda":
            report["profile_ar_step_graph"] = profile_call(lambda: engine.runner.step_forward(token, cache), device)
            print_profile("AR step (graph replay)", report["profile_ar_step_graph"], device)
        _profile_speculative_step(engine, cache, proposer, tree, capture, bonus, config.topk, report, device)
        _profile_prefill_chunk(engine, cache, args.prefill_chunk, report, device)
    if device.type == "cuda":
        report.update(cuda_memory_report())
    if snapshots is not None:
        snapshots.finish()
    report["rows"] = rows
    if _rank_and_world()[0] == 0:  # a tensor-parallel benchmark runs on every rank: rank 0 writes
        save_report(report, args.out)
    _print(report)
    return 0


def q8_sibling(draft: DFlashDraft) -> DFlashDraft:
    """`draft` with its layers in Q8_0, beside it: the module tree copied with the bf16 tensors shared, not
    copied (a second 3.2 GiB at 27B), until `quantize_layers` packs each matrix into a buffer of its own."""
    shared = {id(t): t for t in (*draft.parameters(), *draft.buffers())}
    return copy.deepcopy(draft, memo=shared).quantize_layers("q8_0")


def cuda_memory_report() -> dict:
    """Every GPU this run touched (a layer split or a draft device adds some): the allocator's peak, and the
    process as the device sees it (`ProcessMemory`: used memory, what lies outside the allocator, the peak
    footprint)."""
    touched = [i for i in range(torch.cuda.device_count()) if torch.cuda.max_memory_allocated(i)]
    return {"peak_memory_GiB": {f"cuda:{i}": round(torch.cuda.max_memory_allocated(i) / 2**30, 2) for i in touched},
            "process_memory_GiB": {f"cuda:{i}": measure_process_memory(i).as_gib() for i in touched}}


def _rank_and_world() -> tuple[int, int]:
    """(this rank, ranks) of a tensor-parallel benchmark, (0, 1) for a single process."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _captures(engine) -> bool | None:
    """How `proposer_for` builds the engine's draft passes (None: eager, no graph runner), for a sibling."""
    runner = engine.runner.graph_runner()
    return None if runner is None else runner.steps.capture_graphs


def _module_bytes(module: torch.nn.Module) -> int:
    """Parameters and buffers (a quantized layer keeps its blocks in a buffer)."""
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def _prompt(vocab: int, length: int, seed: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab - 1, (length,), generator=generator).tolist()


def _prefill(engine, cache, ids: list[int], chunk: int) -> None:
    cache.reset()
    engine.runner.prefill(cache, ids, chunk)


def _depth4_path(tree) -> list[int]:
    """The nodes (root first) down the tree's first branch to depth 4: the path a commit keeps."""
    node = 0
    for _ in range(4):
        children = tree.children(node)
        if not children:
            break
        node = min(children.values())
    return tree.path_to(node)


def _profile_speculative_step(engine, cache, proposer, tree, capture, bonus: int, topk: int, report: dict,
                              device) -> None:
    """Where a speculative step's time goes (`--profile`): the draft step, the verify at the default budget,
    that verify followed by the commit of a depth-4 path (the commit's share is the difference), each as
    the timed rows run them (graph replays where the engine captures them), and the one-graph step where the
    engine runs one: its GPU time less the draft's and the verify's is what the tree build, walk and commit
    cost inside it."""
    path = _depth4_path(tree)

    def verify():
        return engine.runner.step_forward(tree.tokens, cache, tree, capture, pad_to=DEFAULT_BUDGET + 1)

    def verify_and_commit():
        engine.runner.commit_step(cache, path, proposer, verify().features)

    parts = [("profile_draft_step", "draft step", lambda: proposer.propose(bonus, cache.length)),
             ("profile_verify", f"verify (budget {DEFAULT_BUDGET})", verify),
             ("profile_verify_and_commit", "verify + commit (depth-4 path)", verify_and_commit)]
    runner = engine.runner.graph_runner()
    if runner is not None and hasattr(proposer, "static_block"):
        parts.append(("profile_speculative_step", f"speculative step (one graph, budget {DEFAULT_BUDGET})",
                      lambda: runner.speculative_step(cache, proposer, bonus, "ddtree", DEFAULT_BUDGET, topk)))
    for key, name, call in parts:
        report[key] = profile_call(call, device)
        print_profile(name, report[key], device)
    report["profile_commit_kernels"] = kernels_beyond(report["profile_verify_and_commit"], report["profile_verify"])
    print_beyond("the commit's (verify + commit less the verify)", report["profile_commit_kernels"])
    if "profile_speculative_step" in report:
        # GPU time, not wall-clock differences of separately timed rows (those read -0.2 to +0.1 ms run to run)
        inside = report["profile_speculative_step"]["ms"] - report["profile_verify"]["ms"] \
            - report["profile_draft_step"]["ms"]
        report["profile_tree_walk_commit_ms"] = round(inside, 3)
        report["profile_tree_walk_commit_kernels"] = kernels_beyond(
            report["profile_speculative_step"], report["profile_verify"], report["profile_draft_step"])
        print(f"\ntree build + walk + commit inside the step graph: {inside:.3f} ms of GPU time "
              f"(the step's kernels less the verify's and the draft step's)")
        print_beyond("by kernel", report["profile_tree_walk_commit_kernels"])


def _device_step_rows(engine, cache, proposer, bonus: int, topk: int, device, repeat: int, ar: float, rows: list,
                      row) -> None:
    """The whole greedy step as the engine runs it where it can (`GraphedForward.speculative_step`: draft, tree,
    verify, walk and commit in one graph), and its part beyond the draft and verify rows above: what the tree
    build, the walk and the commit cost inside it."""
    runner = engine.runner.graph_runner()
    if runner is None or not hasattr(proposer, "static_block"):
        return
    seconds = timed(lambda: runner.speculative_step(cache, proposer, bonus, "ddtree", DEFAULT_BUDGET, topk), device,
                    repeat)
    row(f"speculative step (one graph, budget {DEFAULT_BUDGET})", seconds, vs_ar=round(seconds / ar, 2))
    parts = {r["step"]: r["ms"] for r in rows if "ms" in r}  # not the rows that ran out of memory
    verify = parts.get(f"verify budget {DEFAULT_BUDGET}")
    if verify is not None:
        inside = parts[f"speculative step (one graph, budget {DEFAULT_BUDGET})"] - verify - parts["draft step"]
        row("tree + walk + commit in the step graph", inside / 1e3)


def _chunk_rows(engine, cache, lengths, device, repeat: int, ar: float, roofline_s: float, row) -> None:
    """A short prefill chunk of each length on the committed context, the way a prefix-cache hit or a chat
    message runs it (`ModelRunner.prefill_chunk`); each run writes the same cache rows again (the DeltaNet states
    move on, which changes no time)."""
    for length in lengths:
        ids = _prompt(engine.target.model.config.vocab_size, length, seed=length)
        seconds = timed(lambda: _chunk_again(engine, cache, ids), device, repeat)
        row(f"prefill chunk {length}", seconds, roofline_s, vs_ar=round(seconds / ar, 2),
            tok_s=round(length / seconds, 1))


def _chunk_again(engine, cache, ids: list[int]) -> None:
    """A prefill chunk on the committed context, the cache length left as it was (its rows are written again)."""
    committed = cache.length
    engine.runner.prefill_chunk(cache, ids)
    cache.length = committed


def _profile_prefill_chunk(engine, cache, length: int, report: dict, device) -> None:
    """Where a prefill chunk of `length` tokens spends its time on the committed context (`--profile`): at long
    contexts the prefix's attention (its rows dequantized in pieces, flash attention, the pieces' merge) against
    the chunk's own matmuls (shortened to the rows the cache has left). The chunk's rows are written again each
    run, as in `_chunk_rows`."""
    committed = cache.length
    length = min(length, cache.capacity - committed)
    if length < 1:
        return
    ids = _prompt(engine.target.model.config.vocab_size, length, seed=length)
    report["profile_prefill_chunk"] = profile_call(lambda: _chunk_again(engine, cache, ids), device)
    print_profile(f"prefill chunk of {length} tokens after {committed} rows", report["profile_prefill_chunk"], device)


def _commit_time(engine, cache, proposer, tree, capture, repeat: int) -> float:
    """Commit of a 5-node path after a real verify (the verify itself not timed)."""
    path = _depth4_path(tree)
    device = engine.target.model.device
    times = []
    for _ in range(repeat):
        result = engine.runner.step_forward(tree.tokens, cache, tree, capture, pad_to=DEFAULT_BUDGET + 1)
        start = clock(device)
        engine.runner.commit_step(cache, path, proposer, result.features)
        times.append(clock(device) - start)
    return statistics.median(times)


def _replay(engine, draft, prompt: list[int], args, config) -> dict:
    """Speculative decoding whose draft proposes a recorded continuation at acceptance ~`args.replay_al`.
    The record is a speculative run's own output (a random draft: every step a padded verify), not AR's:
    on the GPU a decode row (M = 1) and a verify row round differently, and on a random-weight model
    one flipped near-tie changes the rest of the text, after which a record from AR is never accepted."""
    base = replace(config, max_new_tokens=args.max_tokens)
    engine.draft = None
    ar = _warm_generate(engine, prompt, replace(base, mode="ar"))
    engine.draft = draft
    record = engine.generate(prompt, base)
    inner = DFlashProposer(engine.target.model, draft, config.draft_window, capture_graphs=_captures(engine))
    replay = engine.draft = ReplayProposer(inner, prompt + record.token_ids, args.replay_al)
    spec = _warm_generate(engine, prompt, base)
    engine.draft = draft
    same = sum(a == b for a, b in zip(record.token_ids, spec.token_ids))
    return {"al_target": args.replay_al, "al": round(spec.stats.acceptance_length, 3),
            "ar_tok_s": round(ar.stats.tokens_per_s, 1), "spec_tok_s": round(spec.stats.tokens_per_s, 1),
            "speedup": round(spec.stats.tokens_per_s / ar.stats.tokens_per_s, 2) if ar.stats.tokens_per_s else 0.0,
            "identical": record.token_ids == spec.token_ids, "same_prefix_tokens": same, "tokens": len(ar.token_ids),
            "identical_to_ar": ar.token_ids == spec.token_ids, "draft_nonfinite_rows": replay.nonfinite_rows,
            "spec_stats": spec.stats.as_dict()}


def _warm_generate(engine, prompt: list[int], config):
    """The second of two equal generations: the first captures the graphs of its shapes (hundreds of ms
    each on the GPU), which a server pays once and not per request (the 2026-12-01 H200 replay timed a cold AR
    generation: 101 tok/s end to end against a 149 tok/s step)."""
    engine.generate(prompt, config)
    return engine.generate(prompt, config)


def _print_header(report: dict) -> None:
    print(f"device: {report['device']}   model: {report['model']}   CUDA graphs: {report['cuda_graphs']}"
          + (f"   tensor parallel: {report['tensor_parallel']} ranks, rank 0's shard below"
             if report["tensor_parallel"] > 1 else ""))
    print(f"weights read per step: {report['weights_bytes_per_step'] / 1e9:.2f} GB   "
          f"read bandwidth: {report['read_bandwidth_GBps']} GB/s"
          + (f"   GPU memory after load: {report['memory_after_load_GiB']} GiB allocated, "
             f"{report['device_used_after_load_GiB']} GiB used on the device"
             if "memory_after_load_GiB" in report else "")
          + (f"   held to --gpu-memory {report['gpu_memory_cap']}" if report.get("gpu_memory_cap") else ""))
    print(f"{'step':<24}{'ms':>10}{'floor ms':>10}{'vs floor':>10}  notes", flush=True)


def _print_row(r: dict) -> None:
    notes = "  ".join(f"{k}={v}" for k, v in r.items() if k not in ("step", "ms", "floor_ms", "vs_floor"))
    print(f"{r['step']:<24}{r['ms']:>10.3f}{r.get('floor_ms', ''):>10}{r.get('vs_floor', ''):>10}  {notes}", flush=True)


def _print(report: dict) -> None:
    cp = report["context_prefill"]
    print(f"context prefill: {cp['tokens']} tokens in {cp['s']} s ({cp['tok_s']} tok/s, first-call compiles included)")
    rp = report.get("replay")
    if rp:
        print(f"replay e2e (AL target {rp['al_target']}): AL {rp['al']}  AR {rp['ar_tok_s']} tok/s  "
              f"spec {rp['spec_tok_s']} tok/s  speedup {rp['speedup']}x  same as its record {rp['identical']} "
              f"({rp['same_prefix_tokens']}/{rp['tokens']} positions equal)  same as AR {rp['identical_to_ar']}"
              f"  draft rows not finite {rp['draft_nonfinite_rows']}")
    if "peak_memory_GiB" in report:
        print(f"peak GPU memory (allocated): {report['peak_memory_GiB']} GiB; peak so far after each phase: "
              f"{report['peak_memory_by_phase_GiB']}; outside the allocator after each phase: "
              f"{report['outside_allocator_by_phase_GiB']}; process footprint so far after each phase: "
              f"{report['footprint_by_phase_GiB']}")
        for name, m in report["process_memory_GiB"].items():
            print(f"process on {name}: peak footprint {m['peak_footprint']} GiB = allocator peak reserved "
                  f"{m['allocator_peak_reserved']} + outside the allocator {m['outside_allocator']} (CUDA context, "
                  f"libraries; device used now {m['device_used']}, allocator reserved now {m['allocator_reserved']})")
