"""`draftsmith train --recipe RECIPE --accelerate-config NAME|FILE`: the `accelerate launch` command
line, built here (so tests can read it) and run as a child whose exit status is ours.

NAME is one of the configs shipped in recipes/accelerate/ (cpu, ddp, zero2, zero3,
fsdp2); anything else must be a path to an accelerate YAML. The child is the same Python
running `accelerate.commands.launch`, so the launch works without `accelerate` on PATH
and inside the virtual environment draftsmith runs in.

accelerate reads a config's `deepspeed_config_file` relative to the working directory, so
a launch from anywhere but the repository root would miss the shipped JSON. A relative path
is therefore looked up against the working directory, then the config's folder and each
folder above it, and the child gets a copy of the config with the path made absolute.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from draftsmith.errors import DraftsmithError
from draftsmith.fsutil import atomic_file

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


def _deepspeed_file(config: Path, written: str) -> Path:
    """Where a config's relative `deepspeed_config_file` is: see the module's docstring."""
    for base in (Path.cwd(), *config.resolve().parents):
        if (base / written).is_file():
            return (base / written).resolve()
    raise DraftsmithError(f"{config}: deepspeed_config_file {written} is neither under the working directory nor "
                          f"under {config.resolve().parent} or a folder above it")


def anywhere(config: Path) -> Path:
    """`config`, or a copy whose relative DeepSpeed JSON path is absolute (named by its
    content in the temporary folder: relaunches reuse it rather than pile up copies)."""
    try:
        data = yaml.safe_load(config.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise DraftsmithError(f"--accelerate-config {config}: not a readable YAML file ({exc})") from None
    deepspeed = data.get("deepspeed_config") if isinstance(data, dict) else None
    written = deepspeed.get("deepspeed_config_file") if isinstance(deepspeed, dict) else None
    if not isinstance(written, str) or Path(written).is_absolute():
        return config
    deepspeed["deepspeed_config_file"] = str(_deepspeed_file(config, written))
    text = yaml.safe_dump(data, sort_keys=False)
    copy = Path(tempfile.gettempdir()) / f"draftsmith-{config.stem}-{hashlib.sha256(text.encode()).hexdigest()[:12]}.yaml"
    if not copy.is_file():
        with atomic_file(copy) as handle:
            handle.write(text)
    return copy


def launch_argv(config: str, recipe: str | None, overrides: list[str] = ()) -> list[str]:
    """`accelerate launch --config_file FILE -m draftsmith.train --recipe RECIPE OVERRIDES...`
    (no --recipe: the built-in recipe)."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
            str(anywhere(accelerate_config(config))), "-m", "draftsmith.train",
            *(["--recipe", str(recipe)] if recipe else []), *overrides]


def launch(argv: list[str]) -> int:
    """Run the launcher in the foreground; its exit status becomes draftsmith's."""
    return subprocess.run(argv).returncode
