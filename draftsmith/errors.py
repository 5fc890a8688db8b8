"""The one error type for bad input.

Anything a user can get wrong (a recipe key, a path, a checkpoint, a dataset) raises
`DraftsmithError` with a one-line message naming the file, key or value. The CLI prints
it as a single line and exits with status 2; tracebacks are for our bugs, not theirs.
"""


class DraftsmithError(Exception):
    """Bad input, reported to the user as one line."""
