"""draftsmith: train speculative-decoding drafters and measure them losslessly.

Its parts live in the checkout's top-level folders (models/, data/, train/, eval/), which
pyproject's package-dir maps onto draftsmith.models and the rest (docs/design.md section 5).
So `import draftsmith` and `import draftsmith.models` are found by different rules: the first
on sys.path (the working directory, say), the second through the editable install's map. With
two checkouts on one interpreter they can be two trees; that is refused here, before any part
is imported, in one line naming both.
"""


def _refuse_two_trees() -> None:
    """ImportError when a part would load from another tree than this file's. Finding a spec
    executes nothing (the parts' __init__ files are not run, torch is not imported)."""
    from importlib.util import find_spec
    from pathlib import Path

    here = Path(__file__).resolve().parent
    for part in ("models", "data", "train", "eval"):
        spec = find_spec(f"{__name__}.{part}")
        if spec is None:
            continue  # not reachable at all: its own import says so
        origin = spec.origin or next(iter(spec.submodule_search_locations or ()), None)
        if origin is None:
            continue
        folder = Path(origin).resolve()
        folder = folder.parent if folder.name == "__init__.py" else folder
        # A checkout keeps the parts beside draftsmith/, a built wheel inside it.
        if folder not in (here.parent / part, here / part):
            raise ImportError(
                f"draftsmith is imported from {here} but draftsmith.{part} would load from {folder}: two checkouts "
                f"on one interpreter (an editable install maps the parts onto its own tree); run from "
                f"{folder.parent} or reinstall this one with `pip install -e {here.parent}`")


_refuse_two_trees()
del _refuse_two_trees
