"""Progress and status go through `logging` under the `draftsmith` logger; `-v` and `-q`
on the command line set how much of it shows (errors stay the CLI's one line).

INFO by default (what a run is doing: its length, a resume, each evaluation, where it
wrote), DEBUG with -v, WARNING with -q (progress bars off too, through tqdm's TQDM_DISABLE),
ERROR with -qq. The level is passed on in the environment, so a training child that
`draftsmith train --accelerate-config` launches (`python -m draftsmith.train`) logs at the
same level.
"""

from __future__ import annotations

import logging
import os
import sys

ROOT = "draftsmith"
LEVEL_ENV = "DRAFTSMITH_LOG_LEVEL"


class _Stderr(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time (a test's capture, a redirect)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):  # StreamHandler.__init__ assigns one; the property decides
        pass


def level_for(verbose: int, quiet: int) -> int:
    return min(logging.ERROR, max(logging.DEBUG, logging.INFO - 10 * verbose + 10 * quiet))


_quieted_tqdm = False  # whether TQDM_DISABLE is ours to lift again


def setup_logging(verbose: int = 0, quiet: int = 0) -> int:
    """Configure the `draftsmith` logger for -v/-q counts and record the level for child
    processes (`inherited_flags`); returns the level."""
    global _quieted_tqdm
    level = level_for(verbose, quiet)
    os.environ[LEVEL_ENV] = logging.getLevelName(level)
    # Bars: ours ask show_progress(); a child process's tqdm reads TQDM_DISABLE when imported
    # (tqdm reads it once, at import, so it cannot switch bars in this process); datasets' own.
    quiet_bars = level > logging.INFO
    if quiet_bars:
        _quieted_tqdm = _quieted_tqdm or "TQDM_DISABLE" not in os.environ
        os.environ["TQDM_DISABLE"] = "1"
    if quiet_bars or _quieted_tqdm:  # lifted again only where -q had put them out
        try:
            from datasets.utils import disable_progress_bars, enable_progress_bars
        except ImportError:
            pass
        else:
            (disable_progress_bars if quiet_bars else enable_progress_bars)()
    if not quiet_bars and _quieted_tqdm:
        os.environ.pop("TQDM_DISABLE", None)
        _quieted_tqdm = False
    logger = logging.getLogger(ROOT)
    logger.setLevel(level)
    if not any(isinstance(h, _Stderr) for h in logger.handlers):
        handler = _Stderr()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
    return level


def inherited_flags() -> list[str]:
    """The -v/-q flags of the level a parent `draftsmith` process recorded (none: INFO)."""
    level = logging.getLevelName(os.environ.get(LEVEL_ENV, "INFO"))
    if not isinstance(level, int) or level == logging.INFO:
        return []
    return ["-v"] if level < logging.INFO else ["-q"] * ((level - logging.INFO) // 10)


def show_progress() -> bool:
    """Whether progress bars show: not under -q (a library caller that configured no logging sees them)."""
    return logging.getLogger(ROOT).level <= logging.INFO
