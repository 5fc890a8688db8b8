"""The command line explains itself: --version, every option's default in its help, the
resolved recipe with each key's meaning (`recipe show`), and `train --accelerate-config`
launching accelerate for the user."""

import argparse
import dataclasses
import json
import re
import sys
from importlib.metadata import version

import pytest
import yaml

from draftsmith.cli import build_parser, main
from draftsmith.errors import DraftsmithError
from draftsmith.recipe import DataSection, Recipe, load_recipe, recipe_to_dict
from draftsmith.registry import METHODS, config_class, trainable
from draftsmith.train import launch as launch_module
from draftsmith.train.launch import accelerate_config, known_configs, launch, launch_argv
from tiny_runs import ROOT, overrides

EAGLE3 = str(ROOT / "recipes" / "tiny" / "eagle3.yaml")


def test_version_is_the_installed_package_metadata(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"draftsmith {version('draftsmith')}"


# ---------------------------------------------------------------- help states defaults

def leaf_parsers(parser, path=()):
    """(command words, parser) for every subcommand that runs something."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
    for action in subs:
        for name, child in action.choices.items():
            yield from leaf_parsers(child, (*path, name))


def test_every_option_of_every_subcommand_states_its_default():
    leaves = dict(leaf_parsers(build_parser()))
    assert {("train",), ("plan",), ("eval",), ("export",), ("data", "regenerate"), ("data", "cache-hidden"),
            ("recipe", "show")} <= set(leaves)
    for words, parser in leaves.items():
        text = parser.format_help()
        assert "(default: None)" not in text, words  # a None default is said in words instead
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
                continue
            assert action.help, (words, action.dest)
            # The formatter appends a default argparse knows; a None one the help says itself.
            if action.option_strings and not action.required and action.default is None:
                assert "default" in action.help.lower(), (words, action.dest)
    # The defaults argparse knows are the ones printed.
    assert re.search(r"--tp TP +tensor-parallel degree \(default 1\)", leaves[("plan",)].format_help())
    regenerate = " ".join(leaves[("data", "regenerate")].format_help().split())
    assert "(default: 8)" in regenerate
    # Unset regeneration flags take the recipe's values; the help quotes the built-in recipe's.
    assert f"(default: the recipe's data.regen_top_k, else {DataSection().regen_top_k})" in regenerate


def test_the_top_level_help_gives_every_command_one_example_that_parses(capsys):
    parser = build_parser()
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    examples = {}
    for line in text.split("commands, one example each:\n")[1].splitlines():
        if "draftsmith " in line:
            command, example = line.split("draftsmith ", 1)
            examples[tuple(command.split())] = example.split()
    assert set(examples) == set(dict(leaf_parsers(parser))), examples.keys()
    for words, example in examples.items():
        args = parser.parse_args(example)  # every example is a valid command line
        assert args.handler is dict(leaf_parsers(parser))[words].get_default("handler"), words


def test_the_recipe_is_passed_one_way_to_every_command():
    leaves = dict(leaf_parsers(build_parser()))
    takes_a_recipe = {words for words, parser in leaves.items()
                      if any(a.dest == "recipe" for a in parser._actions)}
    assert {("train",), ("recipe", "show"), ("eval",), ("data", "regenerate"), ("data", "cache-hidden")} \
        <= takes_a_recipe
    for words in takes_a_recipe:
        (action,) = [a for a in leaves[words]._actions if a.dest == "recipe"]
        assert action.option_strings == ["--recipe"], words


def test_a_recipe_written_first_without_the_option_is_still_taken(capsys):
    for argv in (["recipe", "show", "--recipe", EAGLE3, "train.max_steps=3"],
                 ["recipe", "show", EAGLE3, "train.max_steps=3"]):
        assert main(argv) == 0
        shown = yaml.safe_load(capsys.readouterr().out)
        assert shown["method"]["name"] == "eagle3" and shown["train"]["max_steps"] == 3


def test_eval_takes_the_recipes_sampling_seed_and_tile_and_flags_win(monkeypatch, tmp_path):
    import draftsmith.eval.evaluate as evaluate

    asked = []
    monkeypatch.setattr(evaluate, "evaluate", lambda target, settings, out: asked.append(settings))
    monkeypatch.setattr(evaluate, "print_summary", lambda *a: None)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(json.dumps({"target": {"tile": 64}, "eval": {"top_k": 20, "top_p": 0.8, "seed": 7,
                                                                   "num_draft": 5, "temperature": 0.5}}))
    base = ["eval", "--target", "t", "--drafter", "ngram", "--out", str(tmp_path / "r")]
    assert main([*base, "--recipe", str(recipe)]) == 0
    assert main([*base, "--recipe", str(recipe), "--top-k", "0", "--top-p", "1", "--seed", "1", "--tile", "128",
                 "--num-draft", "tile", "--temperature", "0", "--temperature", "1"]) == 0
    assert main(base) == 0
    got = [(s.top_k, s.top_p, s.seed, s.tile, s.num_draft, s.each_temperature()) for s in asked]
    # `--num-draft tile` is the recipe's null: the tile rule's D.
    assert got == [(20, 0.8, 7, 64, 5, [0.5]), (0, 1.0, 1, 128, None, [0.0, 1.0]), (0, 1.0, 0, 128, None, [0.0])]


def test_eval_sampling_and_draft_count_are_checked_by_one_rule_each(tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(json.dumps({"eval": {"top_p": 1.5}}))
    with pytest.raises(DraftsmithError, match=r"eval: sampling top_p must be in \(0, 1\], got 1.5"):
        load_recipe(recipe)
    base = ["eval", "--target", "t", "--drafter", "ngram", "--out", str(tmp_path / "r")]
    for flags, message in ((["--top-p", "1.5"], "sampling top_p must be in (0, 1], got 1.5"),
                           (["--num-draft", "-1"], "--num-draft must be a number of at least 1, tile (the tile rule's "
                                                   "D) or auto; got -1")):
        assert main([*base, *flags]) == 2
        assert message in capsys.readouterr().err


def test_the_description_names_the_registered_methods():
    description = build_parser().description
    assert all(name in description for name in trainable())


def test_a_fields_choices_and_bounds_are_one_rule_for_the_recipe_the_flag_and_the_help(tmp_path, capsys):
    from draftsmith.eval.settings import CACHE_KINDS

    with pytest.raises(DraftsmithError, match=r"eval.num_prompts: must be at least 1, got 0"):
        load_recipe(None, ["eval.num_prompts=0"])  # refused as the recipe loads, not when eval runs
    with pytest.raises(DraftsmithError, match=r"train.mixed_precision: expected one of auto, no, bf16, fp16"):
        load_recipe(None, ["train.mixed_precision=fp64"])
    base = ["eval", "--target", "t", "--drafter", "ngram", "--out", str(tmp_path / "r")]
    assert main([*base, "--num-prompts", "0"]) == 2
    assert "--num-prompts: must be at least 1, got 0" in capsys.readouterr().err
    leaves = dict(leaf_parsers(build_parser()))
    cache = next(a for a in leaves[("eval",)]._actions if "--cache" in a.option_strings)
    assert cache.choices == list(CACHE_KINDS) and "dynamic (grows)" in cache.help


def test_eval_and_regenerate_flags_are_derived_from_the_recipe_fields():
    from draftsmith.recipe import EvalSection

    leaves = dict(leaf_parsers(build_parser()))
    flags = {words: {s for a in p._actions for s in a.option_strings} for words, p in leaves.items()}
    assert {"--" + f.name.replace("_", "-") for f in dataclasses.fields(EvalSection)} <= flags[("eval",)]
    regen = {"--" + f.name.removeprefix("regen_").replace("_", "-") for f in dataclasses.fields(DataSection)
             if f.name.startswith("regen_") and f.name != "regen_servers"}
    assert regen | {"--server", "--seed", "--chat-template", "--enable-thinking"} <= flags[("data", "regenerate")]
    help_text = " ".join(leaves[("data", "regenerate")].format_help().split())
    assert DataSection.__dataclass_fields__["regen_top_p"].metadata["help"] in help_text


# ---------------------------------------------------------------- data regenerate

def regenerate_settings(monkeypatch, *argv) -> dict:
    """What `data regenerate ARGV` asks of the regeneration, which is not run."""
    import draftsmith.data.regenerate as regen

    asked = {}

    def command(target, out, settings, data, **kw):
        asked.update(vars(settings.decoding), in_flight=settings.in_flight, servers=settings.servers,
                     batch_size=settings.batch_size, dataset_split=data.dataset_split, **kw)
        return out

    monkeypatch.setattr(regen, "regenerate_command", command)
    assert main(["data", "regenerate", "--out", "o.jsonl", *argv]) == 0
    return asked


def test_regenerate_takes_the_recipes_sampling_and_flags_win(monkeypatch, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(json.dumps({"target": {"path": str(tmp_path / "target")}, "train": {"seed": 9}, "data": {
        "regen_temperature": 0.3, "regen_top_p": 0.5, "regen_top_k": 4, "regen_max_new_tokens": 33,
        "regen_in_flight": 5, "dataset_split": "test"}}))
    settings = regenerate_settings(monkeypatch, "--recipe", str(recipe))
    assert {k: settings[k] for k in ("temperature", "top_p", "top_k", "max_new_tokens", "seed", "in_flight",
                                     "dataset_split")} == dict(temperature=0.3, top_p=0.5, top_k=4, max_new_tokens=33,
                                                               seed=9, in_flight=5, dataset_split="test")
    flagged = regenerate_settings(monkeypatch, "--recipe", str(recipe), "--top-k", "0", "--in-flight", "0",
                                  "--temperature", "0")
    assert flagged == {**settings, "top_k": 0, "in_flight": 0, "temperature": 0.0}  # a zero flag is still given
    # No recipe: the built-in recipe's values.
    data = DataSection()
    built_in = regenerate_settings(monkeypatch, "--target", str(tmp_path / "target"))
    assert (built_in["temperature"], built_in["top_p"], built_in["top_k"], built_in["max_new_tokens"], built_in["seed"]) == (
        data.regen_temperature, data.regen_top_p, data.regen_top_k, data.regen_max_new_tokens, Recipe().train.seed)


# ---------------------------------------------------------------- recipe show

def test_every_recipe_field_and_every_method_config_field_has_help():
    classes = [type(getattr(Recipe(), f.name)) for f in dataclasses.fields(Recipe)]
    configs = [config_class(name) for name, spec in METHODS.items() if spec.config]
    assert len(classes) == 6 and len(configs) == len(trainable())  # every trained method has its config
    for cls in [*classes, *configs]:
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help", "").strip(), f"{cls.__name__}.{f.name} has no help"


def show(capsys, *args) -> str:
    assert main(["recipe", "show", *args]) == 0
    return capsys.readouterr().out


def test_recipe_show_prints_the_resolved_recipe_with_defaults_and_meanings(capsys):
    args = [EAGLE3, "train.max_steps=3", "method.ttt_length=2"]
    out = show(capsys, *args)
    recipe = load_recipe(args[0], args[1:])
    # It is YAML whose values are the resolved recipe: defaults < file < overrides.
    shown = yaml.safe_load(out)
    expected = recipe_to_dict(recipe)
    for section in ("target", "data", "train", "eval", "tracking"):
        assert shown[section] == expected[section], section
    method = shown["method"]
    assert method["name"] == "eagle3" and method["ttt_length"] == 2 and method["draft_vocab_size"] == 1024
    assert set(method) == {"name"} | {f.name for f in dataclasses.fields(config_class("eagle3"))}
    lines = {line.split(":")[0].strip(): line for line in out.splitlines() if line.startswith("  ")}
    # A changed key names its default; an unchanged one gives value and meaning only.
    assert lines["max_steps"].endswith("# optimizer steps; at least 0 (default: 1000)")
    assert lines["ttt_length"].endswith("(default: 7)") and "training-time-test" in lines["ttt_length"]
    assert lines["lr"].endswith("# peak learning rate (AdamW); at least 0")
    # the values a key takes, as its field declares them (the one place the check reads too)
    assert lines["mixed_precision"].endswith("one of auto (bf16 where the device has it), no, bf16, fp16")
    assert lines["warmup_ratio"].endswith("; 0 to 1")
    assert "(default" not in lines["ttt_decay"]


def test_recipe_show_refuses_an_unknown_key_as_train_does(capsys):
    codes = [main([*words, EAGLE3, "method.nope=1"]) for words in (["recipe", "show"], ["train"])]
    err = capsys.readouterr().err.splitlines()
    assert codes == [2, 2] and len(err) == 2 and err[0] == err[1]
    assert err[0].startswith("draftsmith: error: ") and "method.nope: unknown key" in err[0]


# ---------------------------------------------------------------- train --accelerate-config

def test_the_launch_command_line(tmp_path):
    argv = launch_argv("cpu", "recipes/tiny/mtp.yaml", ["train.max_steps=2", "method.num_depths=1"])
    assert argv[:3] == [sys.executable, "-m", "accelerate.commands.launch"]
    assert argv[3:] == ["--config_file", str(ROOT / "recipes" / "accelerate" / "cpu.yaml"), "-m", "draftsmith.train",
                        "--recipe", "recipes/tiny/mtp.yaml", "train.max_steps=2", "method.num_depths=1"]
    own = tmp_path / "mine.yaml"
    own.write_text("distributed_type: 'NO'\n")
    assert launch_argv(str(own), "r.yaml")[4] == str(own)  # a file is taken as it is
    assert {"cpu", "ddp", "zero2", "zero3", "fsdp2"} <= set(known_configs())
    with pytest.raises(DraftsmithError, match=r"^--accelerate-config zero9: no such file or accelerate config "
                                              r"\(known: cpu, ddp, .*zero3; or a path"):
        accelerate_config("zero9")


def test_an_unknown_accelerate_config_is_one_line(capsys):
    assert main(["train", EAGLE3, "--accelerate-config", "nope.yaml"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "draftsmith: error: --accelerate-config nope.yaml: no such file or accelerate config "
        f"(known: {', '.join(known_configs())}; or a path to an accelerate YAML)"]


def test_overrides_may_follow_options_but_unknown_options_are_refused(capsys):
    # argparse would stop the overrides at the option; they are kept all the same.
    assert main(["recipe", "show", EAGLE3, "train.max_steps=3", "--", "train.lr=0.5"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["train"]["max_steps"] == 3 and shown["train"]["lr"] == 0.5
    for argv in (["recipe", "show", EAGLE3, "--bogus"], ["plan", "x", "y=1"]):
        with pytest.raises(SystemExit) as done:
            main(argv)
        assert done.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err


def test_the_launcher_exit_status_is_draftsmiths(monkeypatch, capsys):
    assert launch([sys.executable, "-c", "raise SystemExit(3)"]) == 3
    monkeypatch.setattr(launch_module, "launch_argv", lambda *a: [sys.executable, "-c", "raise SystemExit(5)"])
    assert main(["train", EAGLE3, "--accelerate-config", "cpu"]) == 5
    assert "draftsmith: running" in capsys.readouterr().err


def test_train_with_an_accelerate_config_runs_the_recipe_under_accelerate(tmp_path, monkeypatch):
    """Two optimizer steps of the tiny target through `accelerate launch` (the cpu config);
    the overrides come after the option, as users type them."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    run = tmp_path / "mtp"
    tiny = overrides(run, target__num_layers=1, target__hidden_size=32, target__num_heads=2, data__vocab_size=300,
                     data__max_chars=20000, train__max_steps=2, train__batch_size=2, train__seq_len=16,
                     train__validation_every=2, train__validation_batches=1, train__save_every=100)
    assert main(["train", str(ROOT / "recipes" / "tiny" / "mtp.yaml"), "--accelerate-config", "cpu", *tiny]) == 0
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if "train/loss" in r] == [1, 2]
    assert (run / "model").is_dir()
