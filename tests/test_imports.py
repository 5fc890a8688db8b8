"""The import directions docs/design.md section 5 states hold in the code: the test reads the
table from the design page and checks every `draftsmith` import (top-level or inside a
function) of every file of each package folder against it, so the page and the code cannot
drift apart."""

import ast
import re

from tiny_runs import ROOT

PARTS = ("draftsmith", "models", "data", "train", "eval")
ENTRY_POINTS = {"draftsmith/cli.py", "train/__main__.py"}  # the command: reaches every part, each on use


def allowed_imports() -> dict[str, set[str]]:
    """Section 5's table: `SRC/ -> models/, draftsmith/errors, ...` -> {SRC: {targets}}."""
    design = (ROOT / "docs" / "design.md").read_text()
    section = design[design.index("## 5. Layout"):design.index("## 6.")]
    rows = re.findall(r"^ {4}(\w+)/ +-> (.+)$", section, re.M)
    table = {src: {target.strip() for target in targets.split(",")} for src, targets in rows}
    assert set(table) == set(PARTS), f"design.md section 5 states directions for {sorted(table)}, not {PARTS}"
    return table


def target_of(module: str) -> str | None:
    """draftsmith.models.x -> "models/"; draftsmith.errors -> "draftsmith/errors"; others None."""
    parts = module.split(".")
    if parts[0] != "draftsmith" or len(parts) == 1:
        return None
    return f"{parts[1]}/" if parts[1] in PARTS else f"draftsmith/{parts[1]}"


def imports_of(path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names if node.module == "draftsmith"}
    return found


def test_every_import_runs_in_a_direction_the_design_allows():
    table = allowed_imports()
    wrong = []
    for part in PARTS:
        for path in sorted((ROOT / part).rglob("*.py")):
            name = str(path.relative_to(ROOT))
            if name in ENTRY_POINTS:
                continue
            for module in imports_of(path):
                target = target_of(module)
                if target is None or target == f"{part}/":
                    continue  # outside the package, or within its own part
                if target not in table[part] and f"{target.partition('/')[0]}/" not in table[part]:
                    wrong.append(f"{name} imports {module} ({part}/ -> {target})")
    assert not wrong, "imports design.md section 5 does not allow:\n" + "\n".join(wrong)


def test_the_check_sees_a_forbidden_import():
    table = allowed_imports()
    assert target_of("draftsmith.train.loop") == "train/" and "train/" not in table["models"]
    assert target_of("draftsmith.recipe") == "draftsmith/recipe" and "draftsmith/recipe" not in table["models"]
    assert target_of("draftsmith.models.target") == "models/" and "models/" in table["data"]


def test_every_package_folder_is_listed_for_the_wheel():
    """pyproject.toml lists the packages by hand: a subpackage missing there is missing from
    an installed (not editable) draftsmith, which the editable test install would not show."""
    import tomllib

    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {".".join([package, *init.parent.relative_to(ROOT / folder).parts])
             for package, folder in setup["package-dir"].items() for init in (ROOT / folder).rglob("__init__.py")}
    assert "draftsmith.eval.proposers" in found  # the scan sees subpackages
    assert found <= set(setup["packages"]), sorted(found - set(setup["packages"]))


def test_a_second_checkout_on_the_interpreter_is_refused_at_import(tmp_path):
    """Two checkouts on one interpreter: `import draftsmith` finds the one on sys.path (here a
    second tree, run from its folder), while draftsmith.models, .data, ... come through the
    editable install's map, which points at this checkout. Refused at import, in one line
    naming both folders. The second tree needs only draftsmith/__init__.py: the refusal comes
    before any part is imported."""
    import importlib.util
    import os
    import subprocess
    import sys

    import pytest

    spec = importlib.util.find_spec("draftsmith.models")
    if spec is None or spec.origin != str(ROOT / "models" / "__init__.py"):
        pytest.skip("draftsmith is not installed editable from this checkout (pip install -e .)")
    other = tmp_path.resolve() / "other_checkout"
    (other / "draftsmith").mkdir(parents=True)
    (other / "draftsmith" / "__init__.py").write_text((ROOT / "draftsmith" / "__init__.py").read_text())

    def run(cwd):
        return subprocess.run([sys.executable, "-c", "import draftsmith.models"], cwd=cwd, capture_output=True,
                              text=True, env={**os.environ, "PYTHONPATH": str(cwd)}, timeout=60)

    mixed = run(other)
    last = mixed.stderr.strip().splitlines()[-1]
    assert mixed.returncode != 0 and last.startswith("ImportError: "), mixed.stderr
    assert f"from {other / 'draftsmith'} " in last and f"from {ROOT / 'models'}:" in last, last
    assert run(ROOT).returncode == 0  # one tree: imported as ever
