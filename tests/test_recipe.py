"""Recipes: every shipped recipe parses; bad keys and types are named in one line."""

import json
from pathlib import Path

import pytest
import yaml

from draftsmith.cli import main
from draftsmith.errors import DraftsmithError
from draftsmith.recipe import dump_recipe, load_recipe, recipe_from_dict
from draftsmith.registry import config_class

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted(p for p in (ROOT / "recipes").rglob("*.yaml") if "accelerate" not in p.parts)


def test_recipes_exist():
    names = {p.relative_to(ROOT / "recipes").as_posix() for p in RECIPES}
    assert {"tiny/mtp.yaml", "tiny/draft_lm.yaml"} <= names


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.relative_to(ROOT / "recipes").as_posix())
def test_every_recipe_parses_and_says_how_to_launch(path):
    recipe = load_recipe(path)
    first = path.read_text().splitlines()[0]
    assert first.startswith("# Launch:") and ("draftsmith" in first or "accelerate launch" in first)
    assert "Sized for:" in path.read_text().split("\n\n")[0] or "Sized for:" in path.read_text()[:800]
    # The resolved recipe round-trips.
    assert recipe_from_dict(yaml.safe_load(dump_recipe(recipe))) == recipe


@pytest.mark.parametrize("path", sorted((ROOT / "recipes" / "accelerate").glob("*.yaml")), ids=lambda p: p.name)
def test_accelerate_configs_are_complete(path):
    config = yaml.safe_load(path.read_text())
    assert config["distributed_type"] in {"NO", "MULTI_GPU", "MULTI_CPU", "DEEPSPEED", "FSDP"}
    ds_file = config.get("deepspeed_config", {}).get("deepspeed_config_file")
    if ds_file:
        ds = json.loads((ROOT / ds_file).read_text())
        zero = ds["zero_optimization"]
        # accelerate fills these "auto" fields from model.config.hidden_size, which a bare
        # draft module lacks, so they must be explicit.
        for key in ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"):
            assert zero.get(key, 0) != "auto", key


def test_yaml_sets_only_what_differs_and_overrides_win(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("train:\n  lr: 0.5\n  max_steps: 7\nmethod:\n  name: mtp\n  num_depths: 3\n")
    recipe = load_recipe(path, ["train.lr=0.25", "method.num_depths=4", "tracking.report_to=none"])
    assert recipe.train.lr == 0.25 and recipe.train.max_steps == 7
    assert recipe.train.batch_size == 8  # default untouched
    assert recipe.method.params == {"num_depths": 4}
    assert recipe.tracking.report_to == "none"


@pytest.mark.parametrize("override, message", [
    ("train.max_stepz=3", "train.max_stepz: unknown key"),
    ("trian.lr=3", "trian: unknown key"),
    ("train.lr=fast", "train.lr: expected float, got 'fast'"),
    ("train.max_steps=1.5", "train.max_steps: expected int, got 1.5"),
    ("train.resume=3", "train.resume: expected bool | str"),
    ("method.num_depthz=2", "method.num_depthz: unknown key (method.name is not set"),
    ("method.name=mtp method.num_depthz=2", "method.num_depthz: unknown key"),
    ("method.name=medusa", "method.name: unknown method 'medusa'"),
    ("train=3", "train: expected a mapping"),
    ("nokey", "expected key.sub=value"),
    ("train.keep_checkpoints=1", "train.keep_checkpoints: 1 would leave no whole checkpoint"),
])
def test_bad_keys_and_types_name_the_full_path(override, message):
    with pytest.raises(DraftsmithError) as err:
        load_recipe(None, override.split())
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_bad_yaml_file_is_named(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed\n")
    with pytest.raises(DraftsmithError, match=r"bad.yaml is not valid YAML"):
        load_recipe(bad)
    nested = tmp_path / "nested.yaml"
    nested.write_text("train:\n  lrr: 1\n")
    with pytest.raises(DraftsmithError, match=r"nested.yaml: train.lrr: unknown key"):
        load_recipe(nested)


def test_cli_reports_bad_input_in_one_line(tmp_path, capsys):
    assert main(["train", str(tmp_path / "missing.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"draftsmith: error: recipe {tmp_path / 'missing.yaml'} not found"]
    recipe = RECIPES[0]
    assert main(["train", str(recipe), "train.lr=oops"]) == 2
    assert "train.lr: expected float, got 'oops'" in capsys.readouterr().err


def _real_target(name):
    from transformers import LlamaConfig, Qwen3Config

    if name == "llama31_8b":
        return LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                           num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                           rope_theta=500000.0)
    return Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                       rope_theta=1000000.0)


REAL = [p for p in RECIPES if p.parent.name in ("llama31_8b", "qwen3_8b")]


@pytest.mark.parametrize("path", REAL, ids=lambda p: p.relative_to(ROOT / "recipes").as_posix())
def test_real_size_recipes_build_their_drafter_config_for_the_real_target(path):
    """The real-size recipes cannot run here; their drafters must still fit their targets
    (layer ids within depth, block within the tile rule, draft vocab within the vocab)."""
    recipe = load_recipe(path)
    config = _real_target(path.parent.name)
    drafter_config = config_class(recipe.method.name).from_target(config, **recipe.method.params)
    if recipe.method.name in ("dflash", "dspark"):
        drafter_config.check_tile(config, recipe.target.tile)
        expected_block = {"dflash": {"qwen3_8b": 16, "llama31_8b": 10}, "dspark": {"qwen3_8b": 7}}
        assert drafter_config.block_size == expected_block[recipe.method.name][path.parent.name]
        assert max(drafter_config.target_layer_ids) < config.num_hidden_layers
    else:
        assert drafter_config.draft_vocab_size == 32000
        assert drafter_config.target_layer_ids == [1, config.num_hidden_layers // 2 - 1, config.num_hidden_layers - 4]


# Global batch (batch_size x grad_accum x the 8 processes of recipes/accelerate/zero2.yaml) and
# epochs each real recipe takes from its reference (the comments in the recipe cite the file).
REFERENCE_SIZE = {"qwen3_8b/dflash.yaml": (32, 6), "llama31_8b/dflash.yaml": (32, 6),
                  "qwen3_8b/dspark.yaml": (512, 10), "qwen3_8b/eagle3.yaml": (8, 10),
                  "llama31_8b/eagle3.yaml": (8, 10)}


@pytest.mark.parametrize("path", REAL, ids=lambda p: p.relative_to(ROOT / "recipes").as_posix())
def test_real_recipes_are_sized_as_their_references_on_the_node_they_name(path):
    recipe, name = load_recipe(path), path.relative_to(ROOT / "recipes").as_posix()
    launch = path.read_text().splitlines()[0]
    config = launch.split("--accelerate-config ")[1].split()[0]
    processes = yaml.safe_load((ROOT / "recipes" / "accelerate" / f"{config}.yaml").read_text())["num_processes"]
    t = recipe.train
    assert (t.batch_size * t.grad_accum * processes, t.num_epochs) == REFERENCE_SIZE[name]
    assert t.max_steps == 0 and t.seq_len <= _real_target(path.parent.name).max_position_embeddings


def test_max_position_embeddings_is_refused_beside_a_target_path():
    with pytest.raises(DraftsmithError, match="target.max_position_embeddings=4096 sizes only the tiny target"):
        load_recipe(REAL[0], ["target.max_position_embeddings=4096"])
    assert load_recipe(None, ["target.max_position_embeddings=4096"]).target.max_position_embeddings == 4096
