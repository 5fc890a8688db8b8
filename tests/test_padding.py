"""Batches cut to their longest row (data/batching.py) train exactly as rows padded to
train.seq_len did: the masks keep padding out of every loss and every attention. Rows
grouped by length keep their order a function of (seed, epoch), so a resume still
reproduces the uninterrupted run."""

import json

import pytest
import torch
import torch.nn.functional as F

import golden_runs
from draftsmith.data.batching import (
    LengthGroupedSampler,
    batches_of,
    padding_share,
    real_length,
    trim_padding,
)
from draftsmith.models.model_dir import target_folder
from draftsmith.recipe import load_recipe
from draftsmith.train import loaders, loop
from tiny_runs import interrupted

SEQ = 256  # longer than every golden conversation (up to ~190 tokens), so every row carries padding
STEPS = 6


def test_trim_padding_cuts_every_per_position_tensor_to_the_longest_row():
    rows = [{"input_ids": torch.tensor([5, 6, 7, 0, 0, 0]), "attention_mask": torch.tensor([1, 1, 1, 0, 0, 0]),
             "hidden": torch.arange(12.0).view(6, 2), "weight": torch.tensor(1.0)},
            {"input_ids": torch.tensor([5, 6, 0, 0, 0, 0]), "attention_mask": torch.tensor([1, 1, 0, 0, 0, 0]),
             "hidden": torch.zeros(6, 2), "weight": torch.tensor(2.0)}]
    batch = trim_padding(rows)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [5, 6, 0]]
    assert batch["hidden"].shape == (2, 3, 2) and batch["hidden"][0].tolist() == [[0, 1], [2, 3], [4, 5]]
    assert batch["weight"].tolist() == [1.0, 2.0]
    assert real_length(batch["attention_mask"]).tolist() == [3, 2]
    packed = [{"input_ids": torch.tensor([1, 2, 3])}, {"input_ids": torch.tensor([4, 5, 6])}]
    assert trim_padding(packed)["input_ids"].shape == (2, 3)  # no attention mask: rows are all real


def test_length_groups_are_a_function_of_seed_and_epoch_and_cut_padding():
    gen = torch.Generator().manual_seed(0)
    lengths = (torch.rand(1000, generator=gen) ** 3 * 2000 + 16).long().tolist()  # long-tailed, as chat data
    sampler = LengthGroupedSampler(lengths, batch_size=8, seed=3)
    first = list(sampler)
    assert sorted(first) == list(range(1000)) and list(sampler) == first
    sampler.set_epoch(1)
    second = list(sampler)
    assert sorted(second) == list(range(1000)) and second != first
    assert list(LengthGroupedSampler(lengths, 8, seed=4)) != first
    shuffled = torch.randperm(1000, generator=gen).tolist()
    grouped, random = padding_share(lengths, batches_of(first, 8)), padding_share(lengths, batches_of(shuffled, 8))
    assert grouped < 0.1 < 0.5 < random, (grouped, random)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """The golden data and a few steps of its MTP target (the post-hoc runs only need one)."""
    work = tmp_path_factory.mktemp("padding")
    golden_runs.make_data(work)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DRAFTSMITH_CACHE", str(work / "cache"))
        golden_runs.run("mtp", work)
    return work


def posthoc_run(method, work, name, *extra):
    overrides = [o for o in golden_runs.overrides(method, work) if not o.startswith(("train.output_dir", "train.seq_len"))]
    recipe = load_recipe(golden_runs.ROOT / "recipes" / "tiny" / f"{method}.yaml",
                         [*overrides, f"train.seq_len={SEQ}", f"train.output_dir={work / name}", *extra])
    torch.manual_seed(0)
    loop.train(recipe)
    return [json.loads(line) for line in (work / name / "metrics.jsonl").read_text().splitlines()]


def losses(rows):
    return [r["train/loss"] for r in rows if "train/loss" in r] + [r["val/loss"] for r in rows if "val/loss" in r]


@pytest.mark.parametrize("method", ["eagle3", "dflash", "dspark"])
def test_batches_cut_to_their_longest_row_train_as_rows_padded_to_seq_len(work, method, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(work / "cache"))
    # DFlash draws its random anchors over the batch's width: drawn over SEQ in both runs,
    # they are the same anchors, and only the padding differs.
    from draftsmith.models import dflash

    draw = dflash.sample_anchors
    monkeypatch.setattr(dflash, "sample_anchors", lambda mask, n, generator=None, docs=None: draw(
        F.pad(mask, (0, SEQ - mask.shape[1])), n, generator, docs))
    widths = []
    real_collate = loaders.trim_padding

    def recording(rows):
        batch = real_collate(rows)
        widths.append(batch["input_ids"].shape[1])
        return batch

    monkeypatch.setattr(loaders, "trim_padding", recording)
    trimmed = losses(posthoc_run(method, work, f"{method}-trimmed"))
    assert max(widths) < SEQ  # the batches were cut: the comparison is not of equal shapes
    monkeypatch.setattr(loaders, "trim_padding", torch.utils.data.default_collate)
    padded = losses(posthoc_run(method, work, f"{method}-padded"))
    assert len(trimmed) == STEPS + 1
    # Equal up to float32 round-off of the same sums over other shapes (measured: EAGLE-3 1e-7
    # relative, DFlash and DSpark bit-equal).
    assert trimmed == pytest.approx(padded, rel=1e-4)


def test_data_num_proc_tokenizes_in_processes_to_the_same_rows(work, monkeypatch):
    from transformers import AutoTokenizer

    from draftsmith.data import chat, posthoc_rows

    tokenizer = AutoTokenizer.from_pretrained(work / "tokenizer")
    source = work / "conversations.jsonl"
    one = chat.tokenize_conversations(source, tokenizer, SEQ, num_proc=None)
    two = chat.tokenize_conversations(source, tokenizer, SEQ, num_proc=2)
    assert len(one) == 64 and one[:] == two[:]
    asked = []
    real = chat.tokenize_conversations
    monkeypatch.setattr(chat, "tokenize_conversations", lambda *a, **k: asked.append(k["num_proc"]) or real(*a, **k))
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(work / "cache"))
    for procs, expected in ((3, 3), (1, None)):
        recipe = load_recipe(golden_runs.ROOT / "recipes" / "tiny" / "eagle3.yaml",
                             [*golden_runs.overrides("eagle3", work), f"data.num_proc={procs}"])
        posthoc_rows.training_rows(recipe, None, tokenizer, target_folder(recipe.target.path))
        assert asked[-1] == expected


def test_grouped_rows_resume_on_the_uninterrupted_trajectory(work, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(work / "cache"))
    grouped = ("data.group_by_length=true", "train.save_every=3")
    straight = losses(posthoc_run("eagle3", work, "grouped-straight", *grouped))

    from draftsmith.train.eagle3 import Eagle3Training

    # Killed in step 5, after the checkpoint at step 3.
    interrupted(monkeypatch, Eagle3Training, 5, lambda: posthoc_run("eagle3", work, "grouped-broken", *grouped))
    resumed = losses(posthoc_run("eagle3", work, "grouped-broken", *grouped, "train.resume=true"))
    assert resumed == pytest.approx(straight, rel=1e-5)


def test_bench_train_compares_real_tokens_per_second_of_the_four_batchings(tmp_path):
    import sys

    from test_bench_scripts import TINY_TRAIN, md_tables, run

    out = run([sys.executable, "scripts/bench_train.py", *TINY_TRAIN, "--seq", "64", "--padding",
               "--padding-rows", "12", "--padding-batch", "4", "--out", str(tmp_path / "padding.md")])
    [table] = md_tables(out)
    assert [(r["method"], r["batching"]) for r in table] == [
        (m, b) for m in ("eagle3", "dflash", "dspark")
        for b in ("padded to seq_len", "cut to longest row", "cut, grouped by length", "packed")]
    for first, cut, grouped, packed in zip(table[::4], table[1::4], table[2::4], table[3::4]):
        assert first["x padded"] == "1.00x" and float(cut["real tok/s"]) > 0
        # The same rows each way: cutting removes padding, grouping leaves no more of it than random
        # batches, and packing the random batches less than cutting them.
        assert int(cut["padding %"]) < int(first["padding %"]) and int(grouped["padding %"]) <= int(cut["padding %"])
        assert int(packed["padding %"]) < int(cut["padding %"])
    assert md_tables((tmp_path / "padding.md").read_text()) == [table]
