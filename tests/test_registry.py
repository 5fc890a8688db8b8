"""The method registry: every string it holds imports as what it claims, and every table a
test or command keeps per method covers every registered method, so a new method's entry
is covered or fails here naming what it lacks (not when someone first runs that method)."""

import dataclasses
import inspect

import pytest

import golden_runs
from draftsmith.cli import _proposer_options, build_parser
from draftsmith.errors import DraftsmithError
from draftsmith.registry import METHODS, decode_options, import_ref, posthoc, proposer_names, trainable
from draftsmith.train.method import TrainMethod
from draftsmith.train.posthoc import PostHocMethod
from tiny_runs import ROOT


@pytest.mark.parametrize("name", list(METHODS))
def test_every_registry_string_imports_as_what_its_field_says(name):
    spec = METHODS[name]
    refs = spec.refs()
    assert refs["proposer"] == spec.proposer
    for field, ref in refs.items():
        thing = import_ref(ref, f"{name}.{field}")  # a typo fails here: ModuleNotFoundError or AttributeError
        assert callable(thing), f"{name}.{field} = {ref!r} is not callable"
    if spec.config:
        assert dataclasses.is_dataclass(import_ref(spec.config, name)), f"{name}.config is not a dataclass"
    if spec.training:
        base = PostHocMethod if spec.reads_target_features else TrainMethod
        assert issubclass(import_ref(spec.training, name), base), f"{name}.training is not a {base.__name__}"
    if spec.model:
        model = import_ref(spec.model, name)
        assert model.method == name and callable(model.from_native), f"{name}.model is not {name}'s native module"
    assert list(inspect.signature(import_ref(spec.proposer, name)).parameters)[:2] == ["path", "target"]


def test_a_module_missing_from_the_build_is_one_line():
    with pytest.raises(DraftsmithError, match="^method 'x' is not available in this build \\(no_such_module missing\\)$"):
        import_ref("no_such_module:thing", "method 'x'")


@pytest.mark.parametrize("name", trainable())
def test_every_trained_method_has_a_tiny_recipe_and_a_golden_curve(name):
    assert (ROOT / "recipes" / "tiny" / f"{name}.yaml").is_file(), f"method {name!r} has no recipes/tiny/{name}.yaml"
    golden_runs.settings(name)  # fails naming the method when it has no golden settings
    assert golden_runs.golden_file(name).is_file(), f"method {name!r}: run `python scripts/update_golden.py`"


def test_the_per_method_tables_of_the_tests_cover_every_registered_method():
    import test_architectures
    import test_feature_cache

    assert set(METHODS) <= set(test_architectures.METHOD_PROPOSERS), "tests/test_architectures.py: METHOD_PROPOSERS"
    # Every --drafter name is checked losslessly: the lossless test's parametrization holds it.
    lossless = next(m for m in test_architectures.test_greedy_output_equals_generate.pytestmark
                    if m.name == "parametrize" and m.args[0] == "drafter").args[1]
    assert set(proposer_names()) <= set(lossless), sorted(set(proposer_names()) - set(lossless))
    assert set(posthoc()) <= set(test_feature_cache.METHOD) & set(test_feature_cache.TENSORS), \
        "tests/test_feature_cache.py: METHOD and TENSORS"


def test_a_decode_option_is_one_name_from_flag_to_proposer():
    assert decode_options(), "no decode option registered: this test checks nothing"
    parser = build_parser()
    eval_help = parser._subparsers._group_actions[0].choices["eval"].format_help()
    for method, option in decode_options():
        assert option.flag in eval_help
        proposer = import_ref(METHODS[method].proposer, method)
        # The option reaches the proposer class under its own name (load_proposer passes **options on).
        classes = [obj for obj in vars(inspect.getmodule(proposer)).values()
                   if inspect.isclass(obj) and option.name in inspect.signature(obj).parameters]
        assert classes, f"{method}: no proposer class takes {option.name}"
    args = parser.parse_args(["eval", "--target", "t", "--drafter", "ngram", "--out", "o",
                              "--confidence-threshold", "0.25"])
    assert _proposer_options(args) == {"dspark": {"confidence_threshold": 0.25}}
    assert _proposer_options(parser.parse_args(["eval", "--target", "t", "--drafter", "ngram", "--out", "o"])) == {}


def test_the_registry_refuses_a_name_registered_twice():
    from draftsmith.registry import method_table

    eagle3 = METHODS["eagle3"]
    with pytest.raises(ValueError, match="the name 'eagle3' is registered twice"):
        method_table(eagle3, dataclasses.replace(eagle3, variants={}))
    with pytest.raises(ValueError, match="the name 'eagle3_tree' is registered twice"):  # a variant's name too
        method_table(eagle3, dataclasses.replace(METHODS["dflash"], variants={"eagle3_tree": {}}))
    assert list(method_table(*METHODS.values())) == list(METHODS)


@pytest.mark.parametrize("name", [n for n, s in METHODS.items() if s.formats])
def test_a_formats_module_offers_what_export_eval_and_serve_call(name):
    spec = METHODS[name]
    assert list(inspect.signature(spec.face("read")).parameters)[:2] == ["path", "target"]
    assert list(inspect.signature(spec.face("serve")).parameters) == ["folder", "written", "fmt", "latency_table"]
    for fmt, ref in spec.exports.items():  # the engine layouts are written by the method's own formats
        assert fmt == "native" or ref.startswith(spec.formats + ":"), f"{name}: --format {fmt} is written by {ref}"
    with pytest.raises(DraftsmithError, match=f"method {name!r}: its formats offer no 'nothing_here'"):
        spec.face("nothing_here")


# The files that hold a method: only these may name it (a DSpark drafter's files may name its
# DFlash backbone, which they build on), and only the registry names every method.
def _own_files(name: str) -> set[str]:
    return {f"models/{name}.py", f"models/formats/{name}.py", f"train/{name}.py", f"eval/proposers/{name}.py"}


def test_no_shared_code_names_a_method():
    import ast

    names = {variant: spec.name for spec in METHODS.values() for variant in (spec.name, *spec.variants)}
    backbone = {"dspark": {"dflash"}}  # DSpark is DFlash's backbone plus its heads
    found = []
    for folder in ("draftsmith", "models", "train", "data", "eval"):
        paths = sorted((ROOT / folder).rglob("*.py"))
        assert paths, f"{folder}/ holds no code: the scan would pass on nothing"
        for path in paths:
            where = str(path.relative_to(ROOT))
            if where == "draftsmith/registry.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                method = names.get(node.value) if isinstance(node, ast.Constant) and isinstance(node.value, str) else None
                if method is None:
                    continue
                owners = {m for m in METHODS if where in _own_files(m)}
                if method in owners or any(method in backbone.get(o, ()) for o in owners):
                    continue
                found.append(f"{where}:{node.lineno} names {node.value!r}")
    assert not found, "shared code names a method (reach it through its MethodSpec): " + "; ".join(found)


def test_a_seventh_method_is_its_files_and_one_entry(tmp_path, capsys, monkeypatch):
    """design.md's "Adding a method", checked: a method written in one file (tests/seventh_method.py)
    and registered in this process trains, is evaluated losslessly, exports to its own layout,
    prints its serve line, and reads back from that layout, with no shared code changed."""
    import json

    import torch

    import seventh_method
    from chat_fixtures import save_tiny_chat_target
    from draftsmith.cli import main
    from draftsmith.models.target import find_model_dir
    from draftsmith.registry import register, unregister
    from tiny_runs import overrides

    target, run, toy = tmp_path / "target", tmp_path / "run", tmp_path / "toy"
    save_tiny_chat_target("qwen3", target)
    recipe = tmp_path / "bigram.yaml"
    recipe.write_text("method:\n  name: bigram\n  init_std: 0.5\n")
    register(seventh_method.SPEC)
    try:
        with pytest.raises(ValueError, match="registered twice"):
            register(seventh_method.SPEC)
        # held to the rules every registered method is
        test_every_registry_string_imports_as_what_its_field_says("bigram")
        test_a_formats_module_offers_what_export_eval_and_serve_call("bigram")
        assert main(["train", str(recipe), *overrides(run, target__path=target, train__max_steps=4)]) == 0
        proposed, propose = [], seventh_method.BigramProposer.propose
        monkeypatch.setattr(seventh_method.BigramProposer, "propose",
                            lambda self, *args: proposed.append(len((draft := propose(self, *args)).tokens)) or draft)
        # greedy eval checks the drafter's output is the target's, token for token
        assert main(["eval", "--target", str(target), "--drafter", f"bigram:{run}", "--out", str(tmp_path / "bigram"),
                     "--num-prompts", "2", "--max-new-tokens", "12", "--num-draft", "3", "--temperature", "0"]) == 0
        row = json.loads((tmp_path / "bigram" / "report.json").read_text())["drafters"][0]
        assert (row["name"], row["num_draft"]) == ("bigram", 3)
        assert proposed and set(proposed) == {3}  # its drafts reached the verify (a 4-step bigram: none accepted)
        capsys.readouterr()
        assert main(["export", str(run), "--format", "toy", "--out", str(toy)]) == 0
        printed = capsys.readouterr().out
        assert "toy-engine serve --draft" in printed and "a toy layout of" in printed
        back, trained = seventh_method.read(toy), seventh_method.read(find_model_dir(run))  # the weights export read
        assert torch.equal(back.table, trained.table)
    finally:
        unregister("bigram")
    assert "bigram" not in METHODS
