"""A rehearsal of every real recipe (recipes/qwen3_8b, recipes/llama31_8b) as a user runs it on a
GPU node: prepare ShareGPT from the hub, regenerate its answers with the target, train, export,
evaluate. The target is tiny but of the same architecture class (Qwen3 / Llama) and chats with
the same public template (tests/chat_fixtures.py); the recipe is loaded as written and only
these are overridden:
- width and depth: the target is a tiny folder (target.path), so the drafter is sized from it;
- steps and lengths: train.num_epochs -> train.max_steps, seq_len, the eval/save/log cadence,
  regenerated answer length, tokenizing processes (2 cores here, not a node's 8 GPUs' hosts);
- paths: data.dataset, train.output_dir, the tracker (no wandb offline);
- the attention kernel: flash_attention_2 needs CUDA, so SDPA runs in its place;
- vocabulary ids the 8B vocabularies have and a 330-token one cannot: method.mask_token_id
  (151669 / 128002) and EAGLE-3's 32000-row draft vocabulary.
Everything else (chat template and thinking switch, sampling settings, batch x accumulation,
schedule, warmup, clip, loss settings, block size, TTT length, gradient checkpointing) runs
as the recipe gives it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from chat_fixtures import FAMILIES, save_tiny_chat_target
from draftsmith.cli import main
from draftsmith.data.prepare import SOURCES, prepare
from draftsmith.recipe import load_recipe
from hub_fixtures import add_repo

ROOT = Path(__file__).resolve().parents[1]
# recipe folder -> (chat family of tests/chat_fixtures.py, tiny architecture of the same class)
MODELS = {"qwen3_8b": ("qwen3", "qwen3"), "llama31_8b": ("llama31", "llama")}
RECIPES = sorted(p.relative_to(ROOT / "recipes").as_posix() for folder in MODELS
                 for p in (ROOT / "recipes" / folder).glob("*.yaml"))
EXPORT_FORMAT = {"dflash": "zlab", "dspark": "deepspec", "eagle3": "sglang"}
# The class each format's loader builds (z-lab, DeepSpec/SGLang/vLLM, SGLang's EAGLE-3).
EXPORT_CLASS = {"dflash": "DFlashDraftModel", "dspark": "Qwen3DSparkModel", "eagle3": "LlamaForCausalLMEagle3"}


def _turn(who, text):
    return {"from": who, "value": text}


# ShareGPT as the hub serves it (one JSON array), with two-turn conversations, which Qwen3's
# template does not render prefix-preserving, and one unmappable role, which is skipped.
# 72 conversations: DSpark's recipe accumulates 64 micro-batches of one row per step (some
# rows go to the validation split).
SHAREGPT = [
    {"id": str(i), "conversations": [_turn("human", f"What is {i} plus {i}?"), _turn("gpt", f"It is {2 * i}."),
                                     _turn("human", "And twice that?"), _turn("chatgpt", f"{4 * i}.")]}
    for i in range(72)
] + [{"id": "tool", "conversations": [_turn("human", "Run it"), _turn("tool", "done")]}]


pytestmark = pytest.mark.usefixtures("datasets_cache")  # a datasets cache of each test's own


def _overrides(recipe: str, target: Path, data: Path, out: Path, steps: int) -> list[str]:
    written = load_recipe(ROOT / "recipes" / recipe)
    values = {
        "target.path": target, "data.dataset": data, "train.output_dir": out, "tracking.report_to": "none",
        "data.num_proc": 1, "data.regen_max_new_tokens": 12, "train.num_epochs": 0, "train.max_steps": steps,
        "train.seq_len": 96, "train.validation_every": steps, "train.save_every": steps, "train.log_every": 1,
        "train.validation_batches": 1,
        "target.attn_implementation": "sdpa",  # flash-attn is a CUDA kernel: the GPU's part
    }
    if "mask_token_id" in written.method.params:
        values["method.mask_token_id"] = 3  # a special token of the tiny vocabulary the chats never write
    if "draft_vocab_size" in written.method.params:
        values["method.draft_vocab_size"] = 64
    if "num_anchors" in written.method.params:
        values["method.num_anchors"] = 16
    return [f"{key}={value}" for key, value in values.items()]


def rehearse(recipe: str, tmp_path: Path, hub: Path, steps: int, prompts: int) -> dict:
    family, arch = MODELS[recipe.split("/")[0]]
    method = Path(recipe).stem
    target = tmp_path / "target"
    save_tiny_chat_target(family, target, arch=arch, num_layers=10)  # deep enough to spread 5 fused layers

    add_repo(hub, SOURCES["sharegpt"].hub_id,
             {"ShareGPT_V4.3_unfiltered_cleaned_split.json": json.dumps(SHAREGPT).encode()}, repo_type="dataset")
    data = prepare("sharegpt", tmp_path / "sharegpt.jsonl")

    run = tmp_path / "run"
    assert main(["train", str(ROOT / "recipes" / recipe), *_overrides(recipe, target, data, run, steps)]) == 0
    assert main(["export", str(run), "--format", EXPORT_FORMAT[method], "--out", str(tmp_path / "export")]) == 0
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert exported["architectures"] == [EXPORT_CLASS[method]], exported.get("architectures")

    report = tmp_path / "report"
    assert main(["eval", "--target", str(target), "--drafter", f"{method}:{run}", "--recipe",
                 str(ROOT / "recipes" / recipe), "--dataset", str(data), "--num-prompts", str(prompts),
                 "--max-new-tokens", "16", "--out", str(report)]) == 0
    return json.loads((report / "report.json").read_text())


def _check(result: dict, recipe: str) -> None:
    # Lossless: on every prompt (each user turn of each conversation) the drafter's greedy text
    # is the target's own; and the recipe's thinking switch reached the report.
    method = Path(recipe).stem
    assert result["prompts"] and result["drafters"][0]["committed_tokens"] > 0
    for prompt in result["prompts"]:
        assert prompt["outputs"][method] == prompt["outputs"]["plain"]
    expected = False if recipe.startswith("qwen3_8b") else None  # Llama 3.1's template has no switch
    assert result["settings"]["enable_thinking"] is expected


def test_every_real_recipe_is_rehearsed():
    """The table above covers every recipe folder: a new 8B recipe is rehearsed or fails here.
    The MTP pretraining recipes (recipes/pretrain_1b) are rehearsed in test_pretrain_rehearsal.py,
    and those of the embedded real target (recipes/smollm2_135m) run on it in test_real_target.py."""
    from test_pretrain_rehearsal import FOLDER as PRETRAIN_FOLDER
    from test_real_target import RECIPES as REAL_TARGET_FOLDER

    real = {p.name for p in (ROOT / "recipes").iterdir() if p.is_dir()} - {"tiny", "accelerate"}
    assert real == set(MODELS) | {PRETRAIN_FOLDER, REAL_TARGET_FOLDER.name}, real
    assert RECIPES and {r.split("/")[0] for r in RECIPES} == set(MODELS)
    assert {Path(r).stem for r in RECIPES} <= set(EXPORT_FORMAT)
    assert set(FAMILIES) == {family for family, _ in MODELS.values()}


# One reference recipe per method in the default run (Qwen3-8B's); the Llama-3.1-8B ones, the same
# methods at another shape, with the slow checks (about 20 s on 2 cores).
@pytest.mark.parametrize("recipe", [pytest.param(r, marks=pytest.mark.slow) if r.startswith("llama31_8b/") else r
                                    for r in RECIPES])
def test_recipe_rehearsal(recipe, tmp_path, hub_cache):
    _check(rehearse(recipe, tmp_path, hub_cache, steps=1, prompts=1), recipe)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_rehearsal_longer(recipe, tmp_path, hub_cache):
    _check(rehearse(recipe, tmp_path, hub_cache, steps=6, prompts=4), recipe)
