"""Runs the host_rows interpreter cases in one process (TRITON_INTERPRET=1 must be set before triton is imported,
so test_host_rows.py launches this file as a subprocess). Prints one JSON object: case id -> whether the kernel's
rows equal the torch form's bit for bit."""

import json
import os
import sys

import torch

# (rows, bytes a row): a Q4_K row of 5120 values (720 words, one program), a Q8_0 row of 96 values (102 bytes: not
# whole words, byte copies), and a row wider than one program's block (1280 words: two)
TABLES = {"q4_k-5120": (40, 2880), "q8_0-96": (40, 102), "wide": (12, 5120)}
INDEX = {"one": [7], "tree": [3, 3, 0, 11, 5, 9, 1], "out-of-range": [2, -1, 12, 40, 999]}


def case_ids() -> list[str]:
    return [f"{t}-{i}" for t in TABLES for i in INDEX] + ["empty"]


def gather_case(rows: int, width: int, index: list[int], gen: torch.Generator) -> bool:
    from flashtree.kernels.host_rows import gather_rows

    table = torch.randint(0, 256, (rows, width), generator=gen, dtype=torch.uint8)
    ids = torch.tensor(index)
    inside = (ids >= 0) & (ids < rows)
    expected = torch.where(inside[:, None], table[ids.clamp(0, rows - 1)], 0)  # ids outside: rows of zeros
    return torch.equal(gather_rows(table, ids), expected)


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from flashtree.kernels.host_rows import gather_rows

    gen = torch.Generator().manual_seed(0)
    result = {f"{t}-{i}": gather_case(*TABLES[t], INDEX[i], gen) for t in TABLES for i in INDEX}
    result["empty"] = gather_rows(torch.zeros(4, 8, dtype=torch.uint8), torch.zeros(0, dtype=torch.long)).shape == (0, 8)
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
