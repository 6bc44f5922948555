"""What the tests of the CUDA C attention kernels over TQ3_0 rows (attention_decode.cu, attention_verify.cu) share:
whether NVRTC compiles here, small TQ3_0 caches for the CPU-side checks, the reference over the float16 pair
values those kernels decode (`tq3_pair_values`), and the model's call and a CUDA graph's replay checked on the GPU."""

import importlib.util

import torch

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


def caches(kv_heads=4, rows=64, d=256):
    t = kv_type("tq3_0")
    return [t.quantize(torch.randn(kv_heads, rows, d)) for _ in range(2)]


def pair_reference(args: dict) -> torch.Tensor:
    """The reference over the values the float16 pair decode gives."""
    return tree_attention_reference(**pair_decoded(args))


def error_against_triton(args: dict) -> float:
    """The model's call (the output gate, TQ3_0 values rotated back in the combine, bf16 operands) as `tree_attention`
    routes it (the CUDA kernel) against the Triton path (`split` chooses a launch: Triton's); checks the shape."""
    heads, n, d = args["q"].shape
    gate = torch.randn(n, heads, d, device=args["q"].device)
    call = dict(args, gate=gate, unrotate_values=True, operands=torch.bfloat16)
    cuda, triton_path = tree_attention(**call), tree_attention(**call, split=33)
    assert cuda.shape == triton_path.shape == (n, heads * d)
    return relative_error(cuda, triton_path)


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
