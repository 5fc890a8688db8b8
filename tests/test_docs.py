"""The docs are true to the code: every name README.md, docs/design.md and docs/internals.md
give as code exists, and the README's command list is the parser's.

What counts as a name given as code, in a backticked span or a fenced block:
- a file or folder of the repo (`models/target.py`, `proposers/base.py`, `tile.py`,
  `recipes/tiny/dflash.yaml`, `tests/golden/`): it exists (a bare or partial path anywhere
  under the package folders, scripts/ or tests/);
- `path.py: Name`, `path.py::test_name`, `path.py: Name(args)`: the file defines Name at its
  top level (read with `ast`: nothing is imported);
- a dotted name of the package, `draftsmith.models.target` or relative to a folder or module
  (`train.posthoc.LossForward`, `models/hub.dataset_source`, `prepare.SOURCES`,
  `MethodSpec.load`): the module is where pyproject's package-dir puts it (and where the
  installed package finds it), and each name after it is defined there (a class's member,
  its bases' included);
- a call `name(a, b, key=...)` of a function or class defined in the code: every argument
  written as a plain name or `name=` is one of its parameters, the plain ones in its order
  (`*`, `**options` where it takes them); names the code does not define at all are flagged
  in docs/internals.md, the page of the interfaces;
- a `--flag` of a `draftsmith SUBCOMMAND ...` line (a fenced block's command and its
  indented continuation lines, or an inline span such as `eval --num-draft auto`): the
  subcommand's parser has it, and a value written `a|b|c` after a flag with choices is among
  them.
Not names: prose in backticks, recipe keys (`train.seq_len`, `target.tile`: their first part
is a recipe section and the rest no module), other programs' names and flags (`vllm serve`,
`torch.topk`, `DynamicCache.crop`), placeholders (`<X>Drafter`, `write_<format>`) and
globs. The placeholders are checked against every method's files below.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/design.md", "docs/internals.md")
CODE_DIRS = ("draftsmith", "models", "data", "train", "eval", "scripts", "tests")
REPO_DIRS = (*CODE_DIRS, "recipes", "docs")  # a path whose first folder is none of these (RUN/model) is no repo path
RECIPE_SECTIONS = {"target", "data", "train", "eval", "tracking", "method"}
# Spans that read as a module's name but are an object's attributes.
OBJECT_PATHS = {"recipe.method.spec"}  # a Recipe's method section and its registry spec
# Files the code writes (into exports), named as the reader of an export sees them.
WRITTEN_FILES = {"modeling_draftsmith.py"}
# Other libraries' methods internals.md names as what our code calls (transformers' models).
EXTERNAL_CALLS = {"get_input_embeddings", "get_output_embeddings", "get_decoder"}
FILE_SUFFIXES = {"json", "jsonl", "png", "md", "yaml", "txt", "safetensors", "gguf", "lock", "pt", "bin", "html"}
IDENT = re.compile(r"[A-Za-z_]\w*$")


# ---------------------------------------------------------------- the code, read with ast

@cache
def package_dirs() -> dict[str, str]:
    """pyproject's package-dir: "draftsmith.models" -> "models"."""
    import tomllib  # 3.11+, as in test_imports.py

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]


class Defs:
    """One file's definitions: the names bound at its top level, and every function and class
    at any depth (methods too)."""

    def __init__(self, path: Path):
        self.path = path
        tree = ast.parse(path.read_text(), str(path))
        self.top: dict[str, ast.AST] = {}
        for node in tree.body:
            for name in _bound_names(node):
                self.top.setdefault(name, node)
        self.all_defs: list[ast.AST] = [n for n in ast.walk(tree)
                                        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]


def _bound_names(node: ast.AST) -> list[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [t.id for target in node.targets for t in ast.walk(target) if isinstance(t, ast.Name)]
    if isinstance(node, (ast.AnnAssign, ast.AugAssign)) and isinstance(node.target, ast.Name):
        return [node.target.id]
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return [(alias.asname or alias.name).split(".")[0] for alias in node.names]
    if isinstance(node, (ast.If, ast.Try)):  # names bound under `if TYPE_CHECKING:` / try-import
        return [name for child in ast.iter_child_nodes(node) for name in _bound_names(child)]
    return []


@cache
def defs(path: Path) -> Defs:
    return Defs(path)


@cache
def code_files() -> tuple[Path, ...]:
    return tuple(sorted(p for d in CODE_DIRS for p in (ROOT / d).rglob("*.py")))


@cache
def index() -> dict[str, list[tuple[Defs, ast.AST]]]:
    """Every function and class defined anywhere in the code, by name (methods included)."""
    found: dict[str, list[tuple[Defs, ast.AST]]] = {}
    for path in code_files():
        d = defs(path)
        for node in d.all_defs:
            found.setdefault(node.name, []).append((d, node))
    return found


def class_members(node: ast.ClassDef, seen=()) -> set[str]:
    """A class's members (methods, class attributes, dataclass and pydantic fields), its bases'
    that the code defines included."""
    members = {name for child in node.body for name in _bound_names(child)}
    for base in node.bases:
        name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else ""
        for _, other in index().get(name, []):
            if isinstance(other, ast.ClassDef) and other is not node and other not in seen:
                members |= class_members(other, (*seen, node))
    return members


def signature(node: ast.AST) -> tuple[list[str], bool, bool] | None:
    """(parameter names in order, takes *args, takes **kwargs) of a function, or of a class's
    __init__ (else its fields, for dataclasses and NamedTuples); None: unknown."""
    if isinstance(node, ast.ClassDef):
        init = next((c for c in node.body if isinstance(c, ast.FunctionDef) and c.name == "__init__"), None)
        if init is None:
            fields = [c.target.id for c in node.body if isinstance(c, ast.AnnAssign) and isinstance(c.target, ast.Name)]
            return (fields, False, False) if fields else None
        node = init
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    a = node.args
    names = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    if names and names[0] in ("self", "cls"):
        names = names[1:]
    return names, a.vararg is not None, a.kwarg is not None


# ---------------------------------------------------------------- resolving a name the docs give

def module_file(dotted: str) -> Path | None:
    """draftsmith.models.target -> models/target.py, by pyproject's package-dir; None: no module."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        package = ".".join(parts[:n])
        if package in package_dirs():
            folder = ROOT / package_dirs()[package] / Path(*parts[n:]) if parts[n:] else ROOT / package_dirs()[package]
            for candidate in (folder / "__init__.py", folder.with_suffix(".py")):
                if candidate.is_file():
                    return candidate
            return None
    return None


@cache
def unique_basenames() -> dict[str, str]:
    """prepare -> draftsmith.data.prepare, for module names only one package folder holds."""
    found: dict[str, set[str]] = {}
    for package, folder in package_dirs().items():
        for path in (ROOT / folder).rglob("*.py"):
            if path.name != "__init__.py":
                rel = path.relative_to(ROOT / folder).with_suffix("")
                found.setdefault(path.stem, set()).add(".".join([package, *rel.parts]))
    return {name: next(iter(modules)) for name, modules in found.items() if len(modules) == 1}


def longest_module(parts: list[str]) -> tuple[str, Path, list[str]] | None:
    for n in range(len(parts), 0, -1):
        path = module_file(".".join(parts[:n]))
        if path is not None:
            return ".".join(parts[:n]), path, parts[n:]
    return None


def check_attributes(path: Path, rest: list[str]) -> tuple[str | None, ast.AST | None]:
    """(problem or None, the definition reached) for `rest` looked up in the module at `path`."""
    node: ast.AST | None = None
    for i, name in enumerate(rest):
        if i == 0:
            node = defs(path).top.get(name)
            if node is None:
                return f"{rel(path)} defines no {name}", None
        elif isinstance(node, ast.ClassDef):
            if name not in class_members(node):
                return f"{rel(path)}: {rest[i - 1]} has no member {name}", None
            node = next((c for c in node.body if name in _bound_names(c)), None)
        else:
            return None, None  # an attribute of a value: not checked further
    return None, node


def resolve_dotted(span: str) -> tuple[str | None, ast.AST | None] | None:
    """A dotted name (`a.b.c`, slashes read as dots) -> (problem or None, its definition), or None
    where it is no name of ours (a recipe key, another library's name)."""
    if span in OBJECT_PATHS:
        return None
    parts = span.replace("/", ".").split(".")
    if not all(IDENT.match(p) for p in parts):
        return None
    if parts[0] == "draftsmith":
        found = longest_module(parts)
        if found is None:
            return f"no module {span}", None
        return check_attributes(found[1], found[2])
    packages = {folder: package for package, folder in package_dirs().items()}
    if parts[0] in packages:
        found = longest_module([*packages[parts[0]].split("."), *parts[1:]])
        if found is not None and found[0] != packages[parts[0]]:
            return check_attributes(found[1], found[2])
        if parts[0] in RECIPE_SECTIONS:
            return None  # a recipe key: train.seq_len, data.group_by_length
        return (f"no module {span}", None) if found is None else check_attributes(found[1], found[2])
    if parts[0] in RECIPE_SECTIONS or len(parts) < 2:
        return None
    if parts[0] in unique_basenames():
        module = unique_basenames()[parts[0]]
        return check_attributes(module_file(module), parts[1:])
    classes = [(d, n) for d, n in index().get(parts[0], []) if isinstance(n, ast.ClassDef)]
    if classes:
        problems = []
        for d, node in classes:
            if parts[1] in class_members(node):
                member = next((c for c in node.body if parts[1] in _bound_names(c)), None)
                return None, member
            problems.append(f"{parts[0]} ({rel(d.path)}) has no member {parts[1]}")
        return problems[0], None
    return None


def resolve_file(span: str) -> str | None:
    """A path the docs give -> problem or None (exists, or no path of the repo)."""
    if span in WRITTEN_FILES:
        return None
    if (ROOT / span).exists():
        return None
    first = span.split("/")[0]
    if "/" in span:
        if first not in REPO_DIRS and first not in subfolders():
            return None  # RUN/best/model, runs/demo/..., model/mtp/: a run's or an export's folder
        if any((ROOT / d / span).exists() for d in CODE_DIRS) or any(
                p.relative_to(ROOT).as_posix().endswith("/" + span.rstrip("/")) for p in repo_paths()):
            return None
        return f"no file or folder {span}"
    if span.endswith((".py", ".sh")):
        return None if any(p.name == span for p in repo_paths()) else f"no file {span} in the repo"
    return None


@cache
def subfolders() -> set[str]:
    """Folder names inside the repo's folders (proposers, formats, golden), which the docs use
    as the start of a path (`proposers/base.py`)."""
    return {p.name for p in repo_paths() if p.is_dir()}


@cache
def repo_paths() -> tuple[Path, ...]:
    found = []
    for d in REPO_DIRS:
        found += [p for p in (ROOT / d).rglob("*") if "__pycache__" not in p.parts]
    return tuple(found)


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


# ---------------------------------------------------------------- calls and their arguments

def split_call(span: str) -> tuple[str, str] | None:
    """`name.attr(args) -> ...` -> (callee, args); None: not one call."""
    m = re.match(r"([A-Za-z_][\w./]*)\(", span)
    if not m:
        return None
    depth, start = 0, m.end() - 1
    for i in range(start, len(span)):
        depth += {"(": 1, ")": -1}.get(span[i], 0)
        if depth == 0:
            rest = span[i + 1:].strip()
            if rest and not rest.startswith(("->", "[")):
                return None  # a formula: E(d) / T(d)
            return m.group(1), span[start + 1:i]
    return None


def split_args(text: str) -> list[str]:
    args, depth, current, quote = [], 0, "", ""
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            args.append(current.strip())
            current = ""
            continue
        current += ch
    if current.strip():
        args.append(current.strip())
    return args


def check_arguments(callee: str, args: str, node: ast.AST) -> str | None:
    sig = signature(node)
    if sig is None:
        return None
    params, star, starstar = sig
    positional, position = [], -1
    for arg in split_args(args):
        if arg in ("", "...", "*", "/"):
            continue
        if arg.startswith("**"):
            if not starstar:
                return f"{callee} takes no **{arg[2:]}"
            continue
        if arg.startswith("*"):
            if not star:
                return f"{callee} takes no *{arg[1:]}"
            continue
        key = re.match(r"([A-Za-z_]\w*)\s*=(?!=)", arg)
        name = key.group(1) if key else arg if IDENT.match(arg) else None
        if name is None:
            continue  # prose: union of layer ids
        if name not in params:
            if starstar:
                continue  # passed on by keyword: build_tiny_target(seed, arch, ...) -> tiny_config
            return f"{callee} has no parameter {name!r} (it takes {', '.join(params)})"
        if not key:
            if params.index(name) < position:
                return f"{callee}: {name!r} comes before {positional[-1]!r} in its parameters ({', '.join(params)})"
            position = params.index(name)
            positional.append(name)
    return None


def check_call(span: str, doc: str) -> str | None:
    split = split_call(span)
    if split is None:
        return None
    callee, args = split
    if "." in callee or "/" in callee:
        resolved = resolve_dotted(callee)
        if resolved is None:
            return None
        problem, node = resolved
        return problem or (check_arguments(callee, args, node) if node is not None else None)
    candidates = index().get(callee, [])
    if not candidates:
        if doc == "docs/internals.md" and callee not in EXTERNAL_CALLS:
            return f"no function or class {callee} in the code"
        return None
    problems = [check_arguments(callee, args, node) for _, node in candidates]
    return None if None in problems else problems[0]


# ---------------------------------------------------------------- the docs' spans

def fenced_blocks(text: str) -> list[str]:
    return re.findall(r"^```[^\n]*\n(.*?)^```", text, re.M | re.S)


def inline_spans(text: str) -> list[str]:
    prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return [" ".join(s.split()) for s in re.findall(r"`([^`]+)`", prose)]


def check_span(span: str, doc: str) -> str | None:
    m = re.match(r"([\w./-]+\.py)\s*::?\s*(.+)$", span)
    if m:  # path.py: Name, path.py::test_name
        path, rest = m.groups()
        if "<" in path:
            return None
        problem = resolve_file(path)
        if problem:
            return problem
        target = ROOT / path if (ROOT / path).is_file() else next(
            (p for p in repo_paths() if p.as_posix().endswith("/" + path)), None)
        name = re.match(r"[A-Za-z_][\w.]*", rest)
        if target is None or name is None:
            return None
        problem, node = check_attributes(target, name.group(0).split("."))
        if problem or node is None:
            return problem
        call = split_call(rest)
        return check_arguments(call[0], call[1], node) if call else None
    call = split_call(span)
    if call is not None and "<" not in call[0]:
        return check_call(span, doc)
    if any(c in span for c in "<>*{}"):
        return None  # a placeholder or glob: models/<method>.py, write_<format>(...), mtp.*
    if re.fullmatch(r"[\w.\-/]+\.(py|sh|toml|md|yaml)|[\w.\-]+(/[\w.\-]+)*/", span):
        return resolve_file(span)
    if re.fullmatch(r"[\w.\-/]+\.[a-z]+", span) and span.rsplit(".", 1)[1] in FILE_SUFFIXES:
        return None  # a file a command writes: report.json, latency.png
    if "/" in span and "." not in span.rsplit("/", 1)[-1]:
        return None  # a run's folder: best/model
    if re.fullmatch(r"[A-Za-z_]\w*(?:[./][A-Za-z_]\w*)+", span):
        resolved = resolve_dotted(span)
        return resolved[0] if resolved else None
    return None


def test_every_name_the_docs_give_as_code_exists():
    wrong = []
    for doc in DOCS:
        text = (ROOT / doc).read_text()
        for span in inline_spans(text):
            problem = check_span(span, doc)
            if problem:
                wrong.append(f"{doc}: `{span}`: {problem}")
        # the package's dotted names anywhere, fenced blocks too (-m draftsmith.train)
        for dotted in sorted(set(re.findall(r"(?<![\w/.-])draftsmith(?:\.[A-Za-z_]\w*)+", text))):
            resolved = resolve_dotted(dotted)
            if resolved and resolved[0]:
                wrong.append(f"{doc}: {dotted}: {resolved[0]}")
    assert not wrong, "names the docs give that the code does not have:\n" + "\n".join(dict.fromkeys(wrong))


def test_the_dotted_modules_load_from_this_tree():
    """Every `draftsmith.x.y` module the docs name is found by the import system where
    pyproject's package-dir puts it in this checkout (its parents are empty packages, so
    finding it imports nothing heavy)."""
    wrong = []
    for doc in DOCS:
        for dotted in sorted(set(re.findall(r"(?<![\w/.-])draftsmith(?:\.[A-Za-z_]\w*)+", (ROOT / doc).read_text()))):
            found = longest_module(dotted.split("."))
            if found is None:
                continue  # test_every_name_the_docs_give_as_code_exists says so
            spec = importlib.util.find_spec(found[0])
            if spec is None or spec.origin is None or Path(spec.origin).resolve() != found[1].resolve():
                wrong.append(f"{doc}: {found[0]} loads from {spec and spec.origin}, not {rel(found[1])}")
    assert not wrong, "\n".join(wrong)


# ---------------------------------------------------------------- flags of draftsmith commands

@cache
def parser() -> argparse.ArgumentParser:
    from draftsmith.cli import add_verbosity, build_parser

    p = build_parser()
    add_verbosity(p)  # as main() does: -v/-q on every subcommand
    return p


def subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return {name: sub for action in p._actions if isinstance(action, argparse._SubParsersAction)
            for name, sub in action.choices.items()}


def every_parser(p: argparse.ArgumentParser, path=()) -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    return [(path, p), *(pair for name, sub in subparsers(p).items() for pair in every_parser(sub, (*path, name)))]


def long_flags(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {o: a for a in p._actions for o in a.option_strings if o.startswith("--")}


def commands(text: str) -> list[str]:
    """The `draftsmith ...` commands of a page: each fenced block's command lines with their
    indented continuation lines (comments dropped), and inline spans such as
    `draftsmith eval --cache static` or `eval --num-draft auto`."""
    found = []
    for block in fenced_blocks(text):
        current = None
        for line in block.splitlines():
            code = re.sub(r"(^|\s)#.*", "", line).rstrip()
            bare = re.sub(r"^\$\s+", "", code.strip())
            if bare.startswith("draftsmith "):
                if current is not None:
                    found.append(current)
                current = bare
            elif current is not None and code and (line[:1].isspace() or current.endswith("\\")):
                current += " " + bare
            elif current is not None and code:
                found.append(current)
                current = None
        if current is not None:
            found.append(current)
    names = "|".join(re.escape(n) for n in subparsers(parser()))
    for span in inline_spans(text):
        if span.startswith("draftsmith "):
            found.append(span)
        elif re.match(rf"({names}) (\S+ )*--", span):
            found.append("draftsmith " + span)
    return found


def command_flags(command: str) -> tuple[tuple[str, ...], argparse.ArgumentParser, list[tuple[str, str]]]:
    """`draftsmith data regenerate --out F [--top-k 20]` -> (("data", "regenerate"), its parser,
    [(flag, the word after it), ...]); --[no-]x is --x and --no-x."""
    words = re.split(r"[\s\[\]]+", command.replace("--[no-]", "--%"))[1:]
    p, path = parser(), ()
    for word in words:
        if word.startswith("-"):
            continue
        if word in subparsers(p):
            p, path = subparsers(p)[word], (*path, word)
            continue
        break
    flags = []
    for i, word in enumerate(words):
        m = re.fullmatch(r"--(%)?([A-Za-z][\w-]*)(=\S*)?", word)
        if m:
            after = words[i + 1] if i + 1 < len(words) else ""
            flags.append((f"--{m.group(2)}", after))
            if m.group(1):
                flags.append((f"--no-{m.group(2)}", ""))
    return path, p, flags


def flag_problems(text: str, doc: str) -> list[str]:
    wrong = []
    for command in commands(text):
        path, p, flags = command_flags(command)
        known = long_flags(p)
        shown = " ".join(("draftsmith", *path))
        for flag, after in flags:
            action = known.get(flag)
            if action is None:
                wrong.append(f"{doc}: `{shown} {flag}`: no such flag (in: {command})")
            elif action.choices and re.fullmatch(r"[\w.-]+(\|[\w.-]+)*", after) and after.upper() != after:
                bad = [v for v in after.split("|") if v not in action.choices]
                if bad:
                    wrong.append(f"{doc}: `{shown} {flag} {after}`: {bad} not among {list(action.choices)}")
    return wrong


def test_every_flag_the_docs_show_exists():
    wrong = [problem for doc in DOCS for problem in flag_problems((ROOT / doc).read_text(), doc)]
    assert not wrong, "flags the docs show that the parser does not have:\n" + "\n".join(wrong)


def readme_command_section() -> str:
    readme = (ROOT / "README.md").read_text()
    start = readme.index("## The command line, in full")
    return readme[start:readme.index("\n## ", start + 1)]


def unlisted_flags(section: str) -> list[str]:
    """Every option of every subcommand of `build_parser()` (--help aside) that `section`'s
    commands do not show on that subcommand's own lines."""
    from draftsmith.cli import build_parser

    shown: dict[tuple[str, ...], set[str]] = {}
    for command in commands(section):
        path, _, flags = command_flags(command)
        shown.setdefault(path, set()).update(flag for flag, _ in flags)
    return [" ".join(("draftsmith", *path, flag)) for path, p in every_parser(build_parser())
            for flag in sorted(set(long_flags(p)) - {"--help"} - shown.get(path, set()))]


def test_the_readme_command_line_lists_every_flag():
    """README's "The command line, in full" shows every option of every subcommand."""
    missing = unlisted_flags(readme_command_section())
    assert not missing, "README.md's 'The command line, in full' does not show:\n" + "\n".join(missing)


# ---------------------------------------------------------------- the placeholders

PLACEHOLDERS = (("<X>Config", "models", "Config"), ("<X>Drafter", "models", "Drafter"),
                ("<X>Training", "train", "Training"), ("<X>Proposer", "eval/proposers", "Proposer"))


def test_the_placeholders_hold_for_every_method():
    """`<X>Drafter` and its kin: every method's file of that folder defines one class so named,
    with one X across its files, or every page that writes the placeholder names, as code, the
    class the method has instead (draft_lm's `DraftLM`, which builds a transformers model)."""
    from draftsmith.registry import METHODS

    pages = {doc: (ROOT / doc).read_text() for doc in DOCS}
    wrong = []
    for name in METHODS:
        prefixes = set()
        for placeholder, folder, suffix in PLACEHOLDERS:
            path = ROOT / folder / f"{name}.py"
            if not path.is_file():
                continue
            classes = [c for c, node in defs(path).top.items() if isinstance(node, ast.ClassDef)]
            named = [c for c in classes if c.endswith(suffix) and c != suffix]
            if named:
                prefixes |= {c[:-len(suffix)] for c in named}
                continue
            instead = [c for c in classes if not c.endswith(tuple(s for _, _, s in PLACEHOLDERS))]
            for doc, text in pages.items():
                if placeholder in text and not any(re.search(rf"`{c}\b[^`]*`", text) for c in instead):
                    wrong.append(f"{doc} promises {placeholder}, but {rel(path)} has none; say what it has: "
                                 f"{', '.join(instead) or 'no class'}")
        if len(prefixes) > 1:
            wrong.append(f"{name}: its classes disagree on <X>: {sorted(prefixes)}")
    assert not wrong, "\n".join(wrong)


# ---------------------------------------------------------------- the checks see what they look for

@pytest.mark.parametrize("span, doc, problem", [
    ("models/target.py", "README.md", None),
    ("models/nowhere.py", "README.md", "no file or folder"),
    ("proposers/base.py", "README.md", None),
    ("tile.py", "README.md", None),
    ("gone.py", "README.md", "no file"),
    ("RUN/best/model", "README.md", None),
    ("eval/settings.py: EvalSettings", "README.md", None),
    ("eval/settings.py: Nothing", "README.md", "defines no Nothing"),
    ("tests/test_docs.py::test_every_name_the_docs_give_as_code_exists", "README.md", None),
    ("draftsmith.models.target", "README.md", None),
    ("draftsmith.models.nowhere", "README.md", "defines no nowhere"),
    ("draftsmith.fields.finite", "README.md", None),
    ("train.posthoc.LossForward", "README.md", None),
    ("train.posthoc.Nothing", "README.md", "defines no Nothing"),
    ("train.seq_len", "README.md", None),
    ("target.tile", "README.md", None),
    ("MethodSpec.load(field_name)", "README.md", None),
    ("MethodSpec.unload", "README.md", "has no member"),
    ("prepare.prepare(name, out, limit=None, source=None)", "README.md", None),
    ("prepare.prepare(name, out, lim=None)", "README.md", "no parameter 'lim'"),
    ("models/hub.py: dataset_source(spec)", "README.md", "no parameter 'spec'"),
    ("regen_server.regenerate_via_servers(urls, target, tokenizer)", "README.md", "no parameter 'target'"),
    ("regen_server.regenerate_via_servers(urls, served_names, tokenizer, conversations, out_path, sampling,"
     " untemplated, limits, template_kwargs)", "README.md", None),
    ("SpeculativeDecoder(target, proposer, cache=\"static\")", "README.md", "no parameter 'cache'"),
    ("check_layer_ids(layer_ids, model_or_config)", "README.md", "comes before"),
    ("a_function_nobody_wrote(x)", "docs/internals.md", "no function or class"),
    ("torch.topk", "README.md", None),
    ("E(d) / T(d)", "docs/design.md", None),
])
def test_the_check_sees_a_stale_name(span, doc, problem):
    found = check_span(span, doc)
    assert (found is None) if problem is None else (found is not None and problem in found), found


def test_the_flag_checks_see_a_stale_flag():
    text = ("```bash\ndraftsmith eval --target T --cache dynamic|static --[no-]compile   # --not-a-flag\n"
            "    [--no-such-flag 3]\ndraftsmith report R --out DIR\n```\n"
            "and `data regenerate --server URL`, `eval --cache huge`, `vllm serve --speculative-config`")
    wrong = flag_problems(text, "page")
    assert len(wrong) == 2, wrong
    assert "`draftsmith eval --no-such-flag`: no such flag" in wrong[0]
    assert "`draftsmith eval --cache huge`: ['huge'] not among" in wrong[1]
    missing = unlisted_flags(text)
    assert "draftsmith eval --compile" not in missing and "draftsmith eval --no-compile" not in missing
    assert "draftsmith eval --out" in missing and "draftsmith data regenerate --out" in missing
    assert "draftsmith report --out" not in missing and "draftsmith data regenerate --server" not in missing
