"""One exception type for every problem a user can fix; the CLI prints its message as one line."""

import sys

OUT_OF_MEMORY_ADVICE = ("try a smaller --ctx, a quantized KV cache (-ctk/-ctv q8_0 or tq3_0), --draft-type q8_0, "
                        "a smaller --budget, or a larger --gpu-memory")


class FlashtreeError(Exception):
    """A user-facing error: the message names the problem and, where possible, what to do."""


def out_of_memory_summary(exc: BaseException) -> str | None:
    """torch's GPU out-of-memory message up to its allocator details (what was asked, what the process holds,
    what it is allowed), or None for any other exception. Looks torch up in `sys.modules` rather than importing
    it: the CLI imports torch only for the commands that need it."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(exc, torch.OutOfMemoryError):
        return None
    return " ".join(str(exc).split(" Of the allocated memory")[0].split()).rstrip(";")
