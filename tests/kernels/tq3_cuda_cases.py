"""What the tests of the CUDA C attention kernels over TQ3_0 (and Q8_0) rows (attention_decode.cu, attention_verify.cu)
share: whether NVRTC compiles here, small caches for the CPU-side checks, the reference over the float16 values those
kernels decode (`tq3_pair_values`, Q8_0's q * d), and the model's call and a CUDA graph's replay checked on the GPU."""

import importlib.util

import torch

from flashtree.kernels.activations import gated_heads_reference
from flashtree.kernels.kv_quant import kv_type
from flashtree.kernels.tree_attention import tree_attention, tree_attention_reference
from flashtree.nvrtc import compile_cubin

from tests.kernels.tree_attention_cases import pair_decoded, relative_error


def nvrtc_available() -> bool:
    if importlib.util.find_spec("cuda") is None or importlib.util.find_spec("cuda.bindings") is None:
        return False
    try:
        compile_cubin('extern "C" __global__ void probe() {}', "sm_90")
    except Exception:  # no libnvrtc: nothing to compile with
        return False
    return True


def caches(kv_heads=4, rows=64, d=256, kind="tq3_0"):
    t = kv_type(kind)
    return [t.quantize(torch.randn(kv_heads, rows, d)) for _ in range(2)]


def pair_reference(args: dict) -> torch.Tensor:
    """The reference over the values the CUDA kernels decode: TQ3_0's float16 pairs, Q8_0's q * d rounded once to
    float16 (where the Triton kernel's float32 ones are exact)."""
    decoded = pair_decoded(args)
    for side in ("k", "v"):
        kind = kv_type(decoded[f"kv_type_{side}"])
        if kind.name == "q8_0":
            decoded[f"{side}_cache"] = kind.dequantize(decoded[f"{side}_cache"]).half().float()
            decoded[f"kv_type_{side}"] = "f32"
    return tree_attention_reference(**decoded)


def error_against_triton(args: dict) -> float:
    """The model's call (the output gate, TQ3_0 values rotated back in the combine, bf16 operands) as `tree_attention`
    routes it (the CUDA kernel) against the Triton path (`split` chooses a launch: Triton's); checks the shape."""
    heads, n, d = args["q"].shape
    gate = torch.randn(n, heads, d, device=args["q"].device)
    call = dict(args, gate=gate, unrotate_values=True, operands=torch.bfloat16)
    cuda, triton_path = tree_attention(**call), tree_attention(**call, split=33)
    assert cuda.shape == triton_path.shape == (n, heads * d)
    return relative_error(cuda, triton_path)


def errors_against_exact(args: dict) -> tuple[float, float]:
    """The model's call over Q8_0 rows (a query normed before, bf16 operands, the output gate) as `tree_attention`
    routes it (the CUDA kernel) and through the Triton path (`split`), each against the float32 reference with the gate: the
    CUDA kernels decode q * d to float16, Triton's to the bf16 operands, so the two differ by more than either's own
    error and each is held to the exact result instead."""
    heads, n, d = args["q"].shape
    gate = torch.randn(n, heads, d, device=args["q"].device)
    call = dict(args, gate=gate, unrotate_values=True, operands=torch.bfloat16)
    cuda, triton_path = tree_attention(**call), tree_attention(**call, split=33)
    exact = gated_heads_reference(tree_attention_reference(**{**args, "q": args["q"].float()}), gate)
    assert cuda.shape == triton_path.shape == exact.shape == (n, heads * d)
    return relative_error(cuda, exact), relative_error(triton_path, exact)


def error_after_the_start_moved(args: dict, start: int) -> float:
    """Captured once in a CUDA graph, replayed after the start row moved on the device (the launch reads it there):
    the replay's output against the reference at the new start."""
    graph = torch.cuda.CUDAGraph()
    tree_attention(**args, operands=torch.bfloat16)  # compiled and warmed outside the capture
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        out = tree_attention(**args, operands=torch.bfloat16)
    moved = {**args, "start_t": args["start_t"].clone().fill_(start)}
    args["start_t"].fill_(start)
    graph.replay()
    return relative_error(out, pair_reference(moved))
