"""Packed post-hoc batches (data.packing): a batch's conversations end to end in rows, each
attending only within itself, so the target's features and every method's loss on a packed
batch are those of the same rows unpacked."""

import pytest
import torch

from draftsmith.data.batching import trim_padding
from draftsmith.data.packing import first_fit, pack_rows
from draftsmith.models.attention import document_ids
from draftsmith.models.dflash import concat_layers
from draftsmith.models.dflash_blocks import sample_anchors
from draftsmith.models.target import build_tiny_target, freeze, target_forward
from tiny_models import MASK, VOCAB, drafter_for, dspark_for, peaky_target

WIDTH = 40
LENGTHS = (31, 12, 22, 9, 17, 6)  # packed into rows of 40: [31, 9], [22, 17], [12, 6]


def conversation_rows(lengths=LENGTHS, seed=0) -> list[dict[str, torch.Tensor]]:
    """Rows as a post-hoc run stores them: padded on the right to WIDTH, the loss on each
    conversation's answer (its last two thirds), one gap in the answer of the first, and one
    learned whole, so a block near the end of the first would run on into it if let."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for n in lengths:
        ids = torch.zeros(WIDTH, dtype=torch.long)
        ids[:n] = torch.randint(0, MASK, (n,), generator=gen)
        attention = (torch.arange(WIDTH) < n).long()
        loss = attention * (torch.arange(WIDTH) >= n // 3).long()
        rows.append({"input_ids": ids, "attention_mask": attention, "loss_mask": loss})
    rows[0]["loss_mask"][20:23] = 0
    rows[3]["loss_mask"] = rows[3]["attention_mask"].clone()  # all learned (plain text), packed after row 0's answer
    return rows


def placement(rows) -> list[tuple[int, int]]:
    """Where pack_rows puts each row: (packed row, offset)."""
    lengths = [int(r["attention_mask"].sum()) for r in rows]
    where = {}
    for b, members in enumerate(first_fit(lengths, WIDTH)):
        offset = 0
        for i in members:
            where[i] = (b, offset)
            offset += lengths[i]
    return [where[i] for i in range(len(rows))]


def packed_anchors(anchors: torch.Tensor, rows) -> torch.Tensor:
    """Unpacked anchors [B, N] (-1 pads) at their packed coordinates [rows, N'] (-1 pads)."""
    moved: dict[int, list[int]] = {}
    for i, (b, offset) in enumerate(placement(rows)):
        moved.setdefault(b, []).extend(offset + a for a in anchors[i].tolist() if a >= 0)
    width = max(len(v) for v in moved.values())
    return torch.tensor([sorted(moved[b]) + [-1] * (width - len(moved[b])) for b in sorted(moved)])


def test_rows_are_packed_first_fit_longest_first_with_positions_restarting():
    rows = conversation_rows()
    batch = pack_rows(rows)
    assert first_fit(list(LENGTHS), WIDTH) == [[0, 3], [2, 4], [1, 5]]
    assert batch["input_ids"].shape == (3, 40)  # six rows of 40 cut to 31 (186 slots) are 3 of 40 (120)
    assert int(batch["attention_mask"].sum()) == sum(LENGTHS)
    for i, (b, offset) in enumerate(placement(rows)):
        n = LENGTHS[i]
        for key in ("input_ids", "attention_mask", "loss_mask"):
            assert batch[key][b, offset:offset + n].equal(rows[i][key][:n])
        assert batch["position_ids"][b, offset:offset + n].equal(torch.arange(n))
    # Each conversation is a document of its own, and so is a packed row's padding.
    assert document_ids(batch["position_ids"])[2].tolist() == [0] * 12 + [1] * 6 + [2] * 22
    rows_without_mask = [{"input_ids": r["input_ids"]} for r in rows]  # pretraining text: packed already
    assert pack_rows(rows_without_mask)["input_ids"].shape == (6, WIDTH)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_the_target_sees_each_packed_conversation_alone(attention):
    target = freeze(build_tiny_target(seed=1, arch="qwen3", vocab_size=VOCAB, num_layers=3, hidden_size=64,
                                      num_heads=4, num_kv_heads=2))
    target.config._attn_implementation = attention
    rows = conversation_rows()
    unpacked, packed = trim_padding(rows), pack_rows(rows)
    alone = target_forward(target, unpacked["input_ids"], attention_mask=unpacked["attention_mask"], capture=[0, 2])
    together = target_forward(target, packed["input_ids"], position_ids=packed["position_ids"], capture=[0, 2])
    for i, (b, offset) in enumerate(placement(rows)):
        n = LENGTHS[i]
        torch.testing.assert_close(together.logits[b, offset:offset + n], alone.logits[i, :n], rtol=1e-5, atol=1e-5)
        for layer in (0, 2):
            torch.testing.assert_close(together.hidden[layer][b, offset:offset + n], alone.hidden[layer][i, :n],
                                       rtol=1e-5, atol=1e-5)


def test_anchors_are_drawn_per_conversation_and_never_cross_one():
    batch = pack_rows(conversation_rows())
    docs = document_ids(batch["position_ids"])
    mask = batch["loss_mask"]
    anchors = sample_anchors(mask, 3, torch.Generator().manual_seed(0), docs)
    for b in range(anchors.shape[0]):
        taken = [a for a in anchors[b].tolist() if a >= 0]
        assert all(mask[b, a] and mask[b, a + 1] and docs[b, a] == docs[b, a + 1] for a in taken)
        count = int(docs[b].max()) + 1
        valid = (mask[b, :-1] & mask[b, 1:]).bool() & (docs[b, :-1] == docs[b, 1:])
        per_doc = torch.bincount(docs[b, taken], minlength=count)
        assert per_doc.equal(torch.bincount(docs[b, :-1][valid], minlength=count).clamp(max=3))  # each its 3
    # One conversation per row: the same draw as without document ids.
    unpacked = trim_padding(conversation_rows())
    alone = lambda docs: sample_anchors(unpacked["loss_mask"], 5, torch.Generator().manual_seed(3), docs)  # noqa: E731
    assert alone(None).equal(alone(torch.zeros_like(unpacked["loss_mask"])))


def dflash_family_losses(drafter, target, backend="sdpa"):
    """(loss and metrics unpacked, loss and metrics packed) of one batch of conversations, the
    packed one on the packed target's features, at the same anchors."""
    rows = conversation_rows()
    unpacked, packed = trim_padding(rows), pack_rows(rows)
    layers = drafter.config.target_layer_ids
    anchors = sample_anchors(unpacked["loss_mask"], 6, torch.Generator().manual_seed(1))
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    with torch.no_grad():
        alone = target_forward(target, unpacked["input_ids"], attention_mask=unpacked["attention_mask"], capture=layers)
        together = target_forward(target, packed["input_ids"], position_ids=packed["position_ids"], capture=layers)
    extra = (lambda out: (out.logits,)) if hasattr(drafter, "refine") else (lambda out: ())
    unpacked = drafter.loss(concat_layers(alone.hidden, layers), unpacked["input_ids"],
                            unpacked["loss_mask"] * unpacked["attention_mask"], embed, head, *extra(alone), anchors=anchors)
    drafter.config.attention_backend = backend
    packed_loss = drafter.loss(concat_layers(together.hidden, layers), packed["input_ids"],
                               packed["loss_mask"] * packed["attention_mask"], embed, head, *extra(together),
                               anchors=packed_anchors(anchors, rows), position_ids=packed["position_ids"])
    return unpacked, packed_loss


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_a_dflash_family_loss_on_a_packed_batch_is_its_loss_unpacked(target, method):
    drafter = (drafter_for if method == "dflash" else dspark_for)(target, block_size=5).train()
    (loss, metrics), (packed, packed_metrics) = dflash_family_losses(drafter, target)
    torch.testing.assert_close(packed, loss, rtol=1e-5, atol=1e-6)
    assert packed_metrics == pytest.approx(metrics, rel=1e-5, abs=1e-6)
    assert len([k for k in metrics if k.startswith("ce_")]) == drafter.drafts_per_block
    # The gradient too: one optimizer step on either batch is the same step.
    grads = [torch.autograd.grad(value, [p for p in drafter.parameters() if p.requires_grad])
             for value in (loss, packed)]
    for mine, theirs in zip(*grads):
        torch.testing.assert_close(theirs, mine, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_flex_attention_reads_a_packed_batch_as_sdpa_does(target, method):
    drafter = (drafter_for if method == "dflash" else dspark_for)(target, block_size=5)
    with torch.no_grad():  # torch has no flex backward on CPU
        (loss, metrics), (packed, packed_metrics) = dflash_family_losses(drafter, target, backend="flex")
    torch.testing.assert_close(packed, loss, rtol=1e-5, atol=1e-6)
    assert packed_metrics == pytest.approx(metrics, rel=1e-5, abs=1e-6)


def eagle3_losses(backend="sdpa", loss="ce"):
    """(loss and metrics unpacked, loss and metrics packed, the drafter) of one batch of
    conversations through EAGLE-3's TTT unroll, each on its own target features."""
    from draftsmith.models.eagle3 import Eagle3Drafter

    target = peaky_target("llama")
    drafter = Eagle3Drafter.from_target(target, draft_vocab_size=96, ttt_length=3, loss=loss,
                                        attention_backend=backend).train()
    rows = conversation_rows()
    unpacked, packed = trim_padding(rows), pack_rows(rows)
    layers = drafter.config.target_layer_ids
    with torch.no_grad():
        alone = target_forward(target, unpacked["input_ids"], attention_mask=unpacked["attention_mask"], capture=layers)
        together = target_forward(target, packed["input_ids"], position_ids=packed["position_ids"], capture=layers)
    hidden = lambda out: torch.cat([out.hidden[i] for i in layers], dim=-1)  # noqa: E731
    unpacked = drafter.loss(hidden(alone), unpacked["input_ids"], alone.logits, unpacked["loss_mask"],
                            unpacked["attention_mask"])
    packed_loss = drafter.loss(hidden(together), packed["input_ids"], together.logits, packed["loss_mask"],
                               packed["attention_mask"], position_ids=packed["position_ids"])
    return unpacked, packed_loss, drafter


@pytest.mark.parametrize("loss", ["ce", "lk_lambda"])
def test_an_eagle3_loss_on_a_packed_batch_is_its_loss_unpacked(loss):
    (value, metrics), (packed, packed_metrics), drafter = eagle3_losses(loss=loss)
    torch.testing.assert_close(packed, value, rtol=1e-5, atol=1e-6)
    assert packed_metrics == pytest.approx(metrics, rel=1e-5, abs=1e-6)
    params = [p for p in drafter.parameters() if p.requires_grad]
    for mine, theirs in zip(*(torch.autograd.grad(v, params) for v in (value, packed))):
        torch.testing.assert_close(theirs, mine, rtol=1e-4, atol=1e-6)


def test_eagle3_flex_attention_reads_a_packed_batch_as_sdpa_does():
    with torch.no_grad():  # torch has no flex backward on CPU
        (value, metrics), (packed, packed_metrics), _ = eagle3_losses(backend="flex")
    torch.testing.assert_close(packed, value, rtol=1e-5, atol=1e-6)
    assert packed_metrics == pytest.approx(metrics, rel=1e-5, abs=1e-6)
