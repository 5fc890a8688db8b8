"""The one error type for bad input.

Anything a user can get wrong (a recipe key, a path, a checkpoint, a dataset) raises
`DraftsmithError` with a one-line message naming the file, key or value. The CLI prints
it as a single line and exits with status 2; tracebacks are for our bugs, not theirs.
"""


class DraftsmithError(Exception):
    """Bad input, reported to the user as one line."""


class DiskFull(DraftsmithError):
    """A write the system refused (out of space, past the file-size limit, a read-only file
    system, a failing device), said in one line with what was kept; `reason` is the system's
    words and `failure` ours ("the disk is full"), for an outer writer to restate the failure
    for the file it was writing."""

    def __init__(self, message: str, reason: str = "no space left on device", failure: str = "the disk is full"):
        super().__init__(message)
        self.reason, self.failure = reason, failure


def first_lines(exc: BaseException, count: int = 2) -> str:
    """The first `count` non-blank lines of a library's error, joined into one (its type's
    name when it has no message): enough to name the problem without its traceback."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()][:count]
    return " ".join(lines) or type(exc).__name__
