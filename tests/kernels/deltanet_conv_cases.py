"""Runs the deltanet_conv interpreter cases in one process (TRITON_INTERPRET=1 must be set before triton
is imported, so test_deltanet_conv.py launches this file as a subprocess). Prints one JSON object: case
id -> max |kernel - reference| / max |reference| over q, k, v and the gates g, beta."""

import json
import os
import sys

import torch

from flashtree.kernels.deltanet_conv import conv_qkv, conv_qkv_reference
from flashtree.kernels.deltanet_gates import GateInputs, gates_reference

HK, HV, D = 2, 6, 32
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PARENTS = {
    "decode": [-1],
    "run": [-1, 0, 1, 2, 3, 4, 5],  # a prompt chunk or a chain
    "tree": [-1, 0, 0, 1, 1, 2, -1, 6, 3],  # branches, and a second root on the committed prefix
}


RUNS = {"decode-advance": 1, "run-advance": 7}  # parents None (a run) and the state shifted by the call


def case_ids() -> list[str]:
    return [f"{shape}-{d}" for shape in [*PARENTS, *RUNS] for d in DTYPES] + [f"tree-strided-{d}" for d in DTYPES]


def gate_inputs(n: int, dtype, gen) -> GateInputs:
    """b, a as strided rows of one projection (as the fused input projection gives them), both tails of
    softplus and sigmoid."""
    ba = (torch.randn(n, 2 * HV, generator=gen) * 8).to(dtype)
    return GateInputs(ba[:, :HV], ba[:, HV:], -torch.rand(HV, generator=gen) * 4, torch.randn(HV, generator=gen))


def relative(got, want) -> list[float]:
    return [((g - w).abs().max() / w.abs().max()).item() for g, w in zip(got, want)]


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    gen = torch.Generator().manual_seed(0)
    conv_dim = (2 * HK + HV) * D
    weight = torch.randn(conv_dim, 4, generator=gen) * 0.5
    result = {}
    cases = [(name, parents, False) for name, parents in PARENTS.items()] + [("tree-strided", PARENTS["tree"], True)]
    for name, parents, strided in cases:
        parents = torch.tensor(parents)
        inputs = torch.randn(len(parents), conv_dim, generator=gen)
        if strided:  # the conv's columns of the fused input projection's rows, read in place
            inputs = torch.cat([inputs, torch.randn(len(parents), 40, generator=gen)], dim=1)[:, :conv_dim]
        state = torch.randn(3, conv_dim, generator=gen)
        for dname, dtype in DTYPES.items():
            args, gates = (inputs.to(dtype), parents, state, weight, HK, HV, D), gate_inputs(len(parents), dtype, gen)
            # the commit's copy of the inputs (the state's dtype), into buffer rows past the tree's too
            kept = torch.full((len(parents) + 2, conv_dim), float("nan"))
            got = conv_qkv(*args, gates, keep_inputs=kept)
            want = (*conv_qkv_reference(*args), *gates_reference(*gates))
            errors = relative(got, want)
            copied = torch.equal(kept[:len(parents)], inputs.to(dtype).float()) and kept[len(parents):].isnan().all()
            errors.append(0.0 if copied else float("inf"))  # copied, not computed: exact, and nothing past them
            result[f"{name}-{dname}"] = max(errors)
    for name, n in RUNS.items():
        inputs = torch.randn(n, conv_dim, generator=gen)
        state = torch.randn(3, conv_dim, generator=gen)
        for dname, dtype in DTYPES.items():
            states, gates = [state.clone(), state.clone()], gate_inputs(n, dtype, gen)
            got = conv_qkv(inputs.to(dtype), None, states[0], weight, HK, HV, D, gates, advance_state=True)
            want = (*conv_qkv_reference(inputs.to(dtype), None, states[1], weight, HK, HV, D, advance_state=True),
                    *gates_reference(*gates))
            errors = relative(got, want)
            # the shifted state is copied, not computed: it must be exact
            errors.append(0.0 if torch.equal(states[0], states[1]) else float("inf"))
            result[f"{name}-{dname}"] = max(errors)
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
