"""The method registry: every string it holds imports as what it claims, and every table a
test or command keeps per method covers every registered method, so a new method's entry
is covered or fails here naming what it lacks (not when someone first runs that method)."""

import ast
import dataclasses
import inspect
import re
from pathlib import Path

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
    if spec.test_keys:  # the tests' tiny settings: keys its recipe takes, as the recipe checks them
        from draftsmith.recipe import load_recipe

        keys = [f"method.{k}={v}" for k, v in spec.test_keys.items()]
        assert load_recipe(ROOT / "recipes" / "tiny" / f"{name}.yaml", keys).method.params.items() >= \
            spec.test_keys.items(), f"{name}.test_keys"


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
    assert set(posthoc()) <= set(test_feature_cache.TENSORS), "tests/test_feature_cache.py: TENSORS"


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


# The files that hold a method (docs/design.md, "Adding a method"): only these may name it or
# import it (a DSpark drafter's files may name its DFlash backbone, which they build on), and
# only the registry names every method. Everything else is shared code.
SCANNED = ("draftsmith", "models", "train", "data", "eval", "scripts")
BACKBONE = {"dspark": {"dflash"}}  # DSpark is DFlash's backbone plus its heads


def _owner(where: str) -> str | None:
    """The method whose own file `where` (a path from the checkout's root) is; None: shared code."""
    for name in METHODS:
        own = {f"train/{name}.py", f"eval/proposers/{name}.py", f"models/formats/{name}.py"}
        if where in own or (where.startswith(f"models/{name}") and where.count("/") == 1):  # models/<name>*.py
            return name
        if where.startswith(f"eval/proposers/{name}_"):  # a proposer's own helper (eagle3_tree_tuning.py)
            return name
    return None


def _module_owner(module: str) -> str | None:
    """The method whose own file the dotted `module` is (draftsmith.models.dflash: dflash)."""
    parts = module.split(".")
    if parts[0] != "draftsmith" or len(parts) < 2:
        return None
    folder = parts[1:] if parts[1] in ("models", "data", "train", "eval") else parts
    return _owner("/".join(folder) + ".py")


# getattr/hasattr on third-party objects, as (the receiver as written, the attribute; "*" one
# named by a variable): the library leaves these optional, so asking is the only way to read
# them. Nothing on this list is an object of a method; a probe of one fails the scan.
THIRD_PARTY_PROBES = {
    # transformers configs: fields one model family declares and another leaves out (attention
    # shape, positions, dtype, tying, architectures) and the text config of a multimodal one
    "transformers config": {
        ("config", "head_dim"), ("config", "num_attention_heads"), ("config", "get_text_config"),
        ("config", "*"), ("config", "to_dict"), ("config", "dtype"), ("config", "torch_dtype"),
        ("config", "tie_word_embeddings"), ("config", "layer_types"), ("config", "target_hidden_size"),
        ("config", "sliding_window"), ("model.config", "max_position_embeddings"),
        ("target.config", "max_position_embeddings"), ("model.config", "_attn_implementation"),
        ("self.target.config", "_attn_implementation"), ("model.config", "quantization_config"),
        ("target.config", "architectures"), ("target.config", "eos_token_id"), ("gen", "eos_token_id"),
        ("_text_config(model)", "num_hidden_layers"),
        ("_text_config(model)", "base_model_pp_plan"), ("root", "*"),
    },
    # transformers models, their outputs and caches: what one architecture or release has and
    # another lacks (a config, a base model, rotary embeddings, a cache's kind)
    "transformers model": {
        ("model", "config"), ("model_or_config", "config"), ("model", "base_model"),
        ("model", "_no_split_modules"), ("module", "_no_split_modules"), ("owner", "_can_record_outputs"),
        ("item", "target_class"), ("decoder_module(model)", "rotary_emb"), ("target", "generation_config"),
        ("target", "name_or_path"), ("tokenizer", "name_or_path"), ("out", "cache"), ("out", "past_key_values"),
        ("cache", "is_croppable"), ("cache", "is_sliding"), ("layer", "recurrent_states_history"),
    },
    # a transformers model class's forward: its cache keyword was renamed across releases
    "transformers forward": {("cls.forward", "signature")},
    # argparse namespaces: each subcommand declares its own flags
    "argparse namespace": {("args", "*"), ("args", "dataset"), ("args", "overrides"), ("args", "recipe")},
    # torch.distributed: a DTensor's local shard (a plain tensor has none)
    "torch": {("p", "to_local")},
    # the standard library, yaml, datasets and httpx: exception details, typing objects, a
    # thread's deadline, a dataset feature's kind, the connection pool's backend
    "other libraries": {
        ("exc", "strerror"), ("exc", "problem_mark"), ("exc", "problem"), ("tp", "__name__"), ("_DEADLINE", "end"),
        ("feature", "feature"), ("feature", "dtype"), ("transport._pool", "_network_backend"),
        ("flash_attn", "__version__"),
    },
}
_ALLOWED_PROBES = set().union(*THIRD_PARTY_PROBES.values())


def _package(where: str) -> str:
    parts = where.removesuffix(".py").split("/")[:-1]
    return ".".join(parts if parts[0] == "draftsmith" else ["draftsmith", *parts])


def _imports(tree, where: str):
    """(line, module) of every module an import statement reaches, relative ones resolved."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = _package(where).split(".")
                base = ".".join([*package[:len(package) - node.level + 1], *([base] if base else [])])
            yield node.lineno, base
            yield from ((node.lineno, f"{base}.{alias.name}") for alias in node.names)


def _docstrings(tree) -> set[int]:
    return {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)}


def _shared_code_findings(where: str, tree, names_too: bool = True) -> list[str]:
    """What shared file `where` says of a method: its modules imported or named, its objects
    probed (hasattr, getattr with a default or a literal name, inspect.signature), and with
    `names_too` a method's or its decode option's name in code or in a string (not a docstring)."""
    names = {variant for spec in METHODS.values() for variant in (spec.name, *spec.variants)}
    options = {option.name for _, option in decode_options()}
    # a name as a word of a string: dflash_config and "DFlash's" name it; EAGLE-3 is eagle3
    word = re.compile(r"(?<![a-z0-9])(" + "|".join(map(re.escape, sorted(names, key=len, reverse=True))) + r")(?![a-z0-9])")
    found = [f"{where}:{line} imports {module}" for line, module in _imports(tree, where) if _module_owner(module)]
    docs = _docstrings(tree)
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
            if _module_owner(text.partition(":")[0]):
                found.append(f"{where}:{line} names the module {text!r}")
            elif not names_too:
                pass
            elif text in options:
                found.append(f"{where}:{line} names the decode option {text!r}")
            elif id(node) not in docs and (hit := word.search(re.sub(r"(?<=[a-z])-(?=\d)", "", text.lower()))):
                found.append(f"{where}:{line} names {hit.group(1)!r} in {text[:60]!r}")
        elif names_too and isinstance(node, (ast.keyword, ast.arg, ast.Attribute)):
            name = node.arg if not isinstance(node, ast.Attribute) else node.attr
            if name in options:
                found.append(f"{where}:{getattr(node, 'lineno', 0) or line} names the decode option {name!r}")
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        if called in ("signature", "getfullargspec") and node.args:
            if (ast.unparse(node.args[0]), called) not in _ALLOWED_PROBES:
                found.append(f"{where}:{line} inspects a signature: {ast.unparse(node)}")
        elif called == "hasattr" or (called == "getattr" and len(node.args) > 1 and (
                len(node.args) == 3 or isinstance(node.args[1], ast.Constant))):
            receiver, attr = ast.unparse(node.args[0]), node.args[1]
            attr = attr.value if isinstance(attr, ast.Constant) else "*"
            if (receiver, attr) not in _ALLOWED_PROBES:
                found.append(f"{where}:{line} probes {ast.unparse(node)}")
    return found


def _method_file_findings(where: str, tree, owner: str) -> list[str]:
    """Another method's name in a method's own file (its backbone's allowed)."""
    names = {variant: spec.name for spec in METHODS.values() for variant in (spec.name, *spec.variants)}
    return [f"{where}:{node.lineno} names {node.value!r}" for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names
            and names[node.value] != owner and names[node.value] not in BACKBONE.get(owner, ())]


def _scan(root: Path) -> list[str]:
    found = []
    for folder in SCANNED:
        paths = sorted((root / folder).rglob("*.py"))
        assert paths, f"{folder}/ holds no code: the scan would pass on nothing"
        for path in paths:
            where = str(path.relative_to(root))
            if where == "draftsmith/registry.py":  # the method table itself
                continue
            tree, owner = ast.parse(path.read_text()), _owner(where)
            found += (_method_file_findings(where, tree, owner) if owner
                      else _shared_code_findings(where, tree, names_too=folder != "scripts"))
    return found


def test_no_shared_code_names_a_method():
    """Shared code reaches a method through its MethodSpec and declared faces only: it names no
    method, imports none of a method's modules, and probes no object for what a method may have."""
    found = list(dict.fromkeys(_scan(ROOT)))
    assert not found, "shared code knows a method (reach it through its MethodSpec):\n" + "\n".join(found)


def test_the_guard_sees_each_kind_of_method_knowledge():
    """Every kind of finding fires on a line that has it, and only there (a guard that cannot
    fail checks nothing); a method's own files and third-party probes pass."""
    source = "\n".join([
        "from draftsmith.models.dflash_blocks import make_blocks",
        "from draftsmith.models import dspark",
        "from .eagle3 import Eagle3Drafter",
        'ref = "draftsmith.train.mtp:MTPTraining"',
        'records = hasattr(proposer, "confidence_records")',
        'check = getattr(config_class, "check_params", None)',
        "takes = inspect.signature(writer).parameters",
        'row = {"confidence_threshold": 0.5}',
        'line = f"block  DFlash block_size auto = {block}"',
        'limit = getattr(model.config, "max_position_embeddings", None)',
    ])
    found = _shared_code_findings("models/shared.py", ast.parse(source))
    assert sorted({int(f.split(":")[1].split()[0]) for f in found}) == list(range(1, 10)), found
    assert _owner("models/dflash_blocks.py") == "dflash" and _owner("train/dspark.py") == "dspark"
    assert _owner("models/tile.py") is None and _owner("eval/proposers/base.py") is None
    assert not _method_file_findings("train/dspark.py", ast.parse('name = "dflash"'), "dspark")  # its backbone
    assert _method_file_findings("train/eagle3.py", ast.parse('name = "dflash"'), "eagle3")


def test_a_seventh_method_is_its_files_and_one_entry(tmp_path, capsys, monkeypatch):
    """design.md's "Adding a method", checked: a post-hoc method written in one file
    (tests/seventh_method.py) and registered in this process trains on the frozen target's
    captured hidden states, is evaluated losslessly (reading them from the verify passes), takes its per-run option as an
    eval flag and chosen with D by `--num-draft auto` (its report column beside), exports to its own
    layout, prints its serve line, and reads back from that layout, with no shared code changed."""
    import json

    import torch

    import seventh_method
    from chat_fixtures import save_tiny_chat_target
    from draftsmith.cli import main
    from draftsmith.models.model_dir import find_model_dir
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
        # trained post hoc: the frozen target's answers regenerated, its hidden states captured
        assert main(["train", str(recipe), *overrides(run, target__path=target, train__max_steps=4, train__seq_len=160,
                                                       data__num_conversations=16, data__prompt_chars=120,
                                                       data__regen_max_new_tokens=16)]) == 0
        assert json.loads((run / "model" / "config.json").read_text())["config"]["target_layer_ids"] == [3]  # the last of 4
        proposed, propose = [], seventh_method.BigramProposer.propose
        monkeypatch.setattr(seventh_method.BigramProposer, "propose",
                            lambda self, *args: proposed.append((len((draft := propose(self, *args)).tokens),
                                                                 tuple(self.hidden.shape))) or draft)
        # greedy eval checks the drafter's output is the target's, token for token
        evaluate = ["eval", "--target", str(target), "--drafter", f"bigram:{run}", "--num-prompts", "2",
                    "--max-new-tokens", "12", "--temperature", "0"]
        assert main([*evaluate, "--out", str(tmp_path / "bigram"), "--num-draft", "3", "--min-prob", "0"]) == 0
        row = json.loads((tmp_path / "bigram" / "report.json").read_text())["drafters"][0]
        assert (row["name"], row["num_draft"], row["extra"]) == ("bigram", 3, {"min_prob": 0.0})
        # its drafts reached the verify, each drafted from the target's hidden state the verify captured
        assert proposed and set(proposed) == {(3, (1, 64))}
        # --num-draft auto chooses its option with D, the evaluated drafter takes it, the report shows it
        assert main([*evaluate, "--out", str(tmp_path / "auto"), "--num-draft", "auto", "--calibration-prompts", "2"]) == 0
        row = json.loads((tmp_path / "auto" / "report.json").read_text())["drafters"][0]
        auto = row["num_draft_auto"]
        assert auto["min_prob"] in seventh_method.MIN_PROBS and auto["options"] == {"min_prob": auto["min_prob"]}
        assert row["extra"] == {"min_prob": auto["min_prob"]} and row["num_draft"] == auto["chosen"]
        assert "| min prob |" in (tmp_path / "auto" / "report.md").read_text()
        capsys.readouterr()
        assert main(["export", str(run), "--format", "toy", "--out", str(toy)]) == 0
        printed = capsys.readouterr().out
        assert "toy-engine serve --draft" in printed and "a toy layout of" in printed
        back, trained = seventh_method.read(toy), seventh_method.read(find_model_dir(run))  # the weights export read
        assert torch.equal(back.table, trained.table)
    finally:
        unregister("bigram")
    assert "bigram" not in METHODS
