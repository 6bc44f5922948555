"""One exception type for every problem a user can fix; the CLI prints its message as one line."""


class FlashtreeError(Exception):
    """A user-facing error: the message names the problem and, where possible, what to do."""
