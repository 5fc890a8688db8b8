"""`draftsmith train RECIPE --accelerate-config NAME|FILE`: the `accelerate launch` command
line, built here (so tests can read it) and run as a child whose exit status is ours.

NAME is one of the configs shipped in recipes/accelerate/ (cpu, ddp, zero2, zero3,
fsdp2); anything else must be a path to an accelerate YAML. The child is the same Python
running `accelerate.commands.launch`, so the launch works without `accelerate` on PATH
and inside the virtual environment draftsmith runs in.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from draftsmith.errors import DraftsmithError

# The repository's recipes/accelerate/ (an editable install), then the working directory's.
CONFIG_DIRS = (Path(__file__).resolve().parents[1] / "recipes" / "accelerate", Path("recipes") / "accelerate")


def known_configs() -> list[str]:
    return sorted({p.stem for d in CONFIG_DIRS if d.is_dir() for p in d.glob("*.yaml")})


def accelerate_config(name_or_file: str) -> Path:
    """A shipped config's file by NAME, or FILE itself; anything else is one line."""
    path = Path(name_or_file)
    if path.is_file():
        return path
    for folder in CONFIG_DIRS:
        candidate = folder / f"{name_or_file}.yaml"
        if candidate.is_file():
            return candidate
    known = ", ".join(known_configs()) or "none found"
    raise DraftsmithError(f"--accelerate-config {name_or_file}: no such file or accelerate config "
                          f"(known: {known}; or a path to an accelerate YAML)")


def launch_argv(config: str, recipe: str, overrides: list[str] = ()) -> list[str]:
    """`accelerate launch --config_file FILE -m draftsmith.train RECIPE OVERRIDES...`."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(accelerate_config(config)),
            "-m", "draftsmith.train", str(recipe), *overrides]


def launch(argv: list[str]) -> int:
    """Run the launcher in the foreground; its exit status becomes draftsmith's."""
    return subprocess.run(argv).returncode
