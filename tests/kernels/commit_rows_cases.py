"""Runs the commit_rows interpreter cases in one process (TRITON_INTERPRET=1 must be set before triton is
imported, so test_commit_rows.py launches this file as a subprocess). Prints one JSON object: case id ->
whether the kernel's result equals the torch form's bit for bit."""

import json
import os
import sys

import torch

# paths of a verified tree: node i at tree row >= i, so sources overlap later destinations
PATHS = {"one": [0], "chain": [0, 1, 2, 3], "skips": [0, 2, 3, 5], "deep": [0, 3, 7, 8, 12, 19]}
CACHES = {"bf16-256": (torch.bfloat16, 256), "f32-300": (torch.float32, 300), "q8-272": (torch.uint8, 272)}
WINDOWS = {"f32-bf16": (torch.float32, torch.bfloat16), "bf16-bf16": (torch.bfloat16, torch.bfloat16)}


def case_ids() -> list[str]:
    return ([f"move-{c}-{p}" for c in CACHES for p in PATHS] + [f"shift-{w}-{p}" for w in WINDOWS for p in PATHS]
            + ["shift-strided-inputs"] + [f"shift-padded-{p}" for p in PATHS]
            + [f"together-{c}-{p}" for c in CACHES for p in PATHS] + ["together-two-types"]
            + [f"windows-{w}-{p}" for w in WINDOWS for p in PATHS])


def _cache(dtype: torch.dtype, width: int, gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.uint8:
        return torch.randint(0, 256, (3, 40, width), generator=gen, dtype=torch.uint8)
    return torch.randn(3, 40, width, generator=gen).to(dtype)


def move_case(dtype: torch.dtype, width: int, path: list[int], gen: torch.Generator) -> bool:
    from flashtree.kernels.commit_rows import move_rows

    cache = _cache(dtype, width, gen)
    start = 11
    rows, source = start + torch.arange(len(path)), start + torch.tensor(path)
    expected = cache.clone()
    expected.index_copy_(1, rows, expected.index_select(1, source))
    move_rows(cache, rows, source)
    return torch.equal(cache, expected)


def together_case(specs: list[tuple[torch.dtype, int]], path: list[int], gen: torch.Generator) -> bool:
    """Several caches (some of another type: two tables) moved by `move_rows_together`, against `move_rows` on
    each; every cache a whole allocation, as the engine's are."""
    from flashtree.kernels.commit_rows import RowTable, move_rows_together

    caches = [_cache(dtype, width, gen) for dtype, width in specs]
    start = 9
    rows, source = start + torch.arange(len(path)), start + torch.tensor(path)
    expected = [c.clone() for c in caches]
    for c in expected:
        c.index_copy_(1, rows, c.index_select(1, source))
    tables = RowTable.group(caches)
    if len(tables) != len(set(specs)):
        return False
    for table in tables:
        move_rows_together(table, rows, source)
    return all(torch.equal(c, e) for c, e in zip(caches, expected))


def windows_case(dtype: torch.dtype, path: list[int], gen: torch.Generator) -> bool:
    """Four layers' windows shifted together from their kept inputs (the windows' dtype, 32 rows), by a path padded
    to 8 rows with its length on the device, against `shift_window` on each."""
    from flashtree.kernels.commit_rows import WindowTable, shift_window, shift_windows_together

    windows = [torch.randn(3, 700, generator=gen).to(dtype) for _ in range(4)]
    inputs = [torch.randn(32, 700, generator=gen).to(dtype) for _ in range(4)]
    padded, count = torch.tensor(path + [0] * (8 - len(path))), torch.tensor([len(path)])
    expected = [w.clone() for w in windows]
    for w, x in zip(expected, inputs):
        shift_window(w, x, padded, count)
    shift_windows_together(WindowTable.of(windows, inputs), padded, count)
    return all(torch.equal(w, e) for w, e in zip(windows, expected))


def shift_case(window_dtype: torch.dtype, input_dtype: torch.dtype, path: list[int], gen: torch.Generator,
               strided: bool = False, padded: bool = False) -> bool:
    from flashtree.kernels.commit_rows import shift_window

    window = torch.randn(3, 700, generator=gen).to(window_dtype)
    inputs = torch.randn(24, 2 * 700 if strided else 700, generator=gen).to(input_dtype)
    if strided:
        inputs = inputs[:, ::2]  # not unit-stride: the torch form runs
    nodes = torch.tensor(path)
    expected = torch.cat([window, inputs[nodes].to(window_dtype)])[-3:]
    if padded:  # a commit graph's path: padded with the root to 8 rows, its length on the device
        shift_window(window, inputs, torch.tensor(path + [0] * (8 - len(path))), torch.tensor([len(path)]))
    else:
        shift_window(window, inputs, nodes)
    return torch.equal(window, expected)


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    gen = torch.Generator().manual_seed(0)
    result = {}
    for c, (dtype, width) in CACHES.items():
        for p, path in PATHS.items():
            result[f"move-{c}-{p}"] = move_case(dtype, width, path, gen)
    for w, (window_dtype, input_dtype) in WINDOWS.items():
        for p, path in PATHS.items():
            result[f"shift-{w}-{p}"] = shift_case(window_dtype, input_dtype, path, gen)
    result["shift-strided-inputs"] = shift_case(torch.float32, torch.bfloat16, PATHS["skips"], gen, strided=True)
    for p, path in PATHS.items():
        result[f"shift-padded-{p}"] = shift_case(torch.float32, torch.bfloat16, path, gen, padded=True)
    for c, spec in CACHES.items():
        for p, path in PATHS.items():
            result[f"together-{c}-{p}"] = together_case([spec] * 5, path, gen)
    for w, (window_dtype, _) in WINDOWS.items():
        for p, path in PATHS.items():
            result[f"windows-{w}-{p}"] = windows_case(window_dtype, path, gen)
    result["together-two-types"] = together_case([CACHES["q8-272"], CACHES["bf16-256"]] * 3, PATHS["deep"], gen)
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
