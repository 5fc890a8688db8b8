import pytest
import torch

from draftsmith.data.draft_vocab import build_draft_vocab
from draftsmith.errors import DraftsmithError


def test_most_frequent_masked_tokens_sorted_by_id():
    ids = [torch.tensor([[5, 5, 5, 9, 9, 2], [7, 7, 7, 7, 3, 3]])]
    # Token 7 is the most frequent overall but only the unmasked half of it counts.
    masks = [torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1]])]
    d2t, t2d = build_draft_vocab(ids, masks, target_vocab_size=12, draft_vocab_size=3)
    # counts: 5 -> 3, 9 -> 2, 3 -> 2, 2 -> 1, 7 -> 1: top three are 5, then 3 and 9 (tie)
    target_ids = torch.arange(3) + d2t
    assert target_ids.tolist() == [3, 5, 9]
    assert d2t.dtype == torch.int64 and (d2t >= 0).all()
    assert t2d.dtype == torch.bool and t2d.nonzero().flatten().tolist() == [3, 5, 9]


def test_ties_go_to_the_lower_id_and_batches_accumulate():
    batches = [torch.tensor([8, 4]), torch.tensor([6, 1, 1])]
    d2t, _ = build_draft_vocab(batches, None, target_vocab_size=10, draft_vocab_size=3)
    assert (torch.arange(3) + d2t).tolist() == [1, 4, 6]  # 1 twice; 4, 6, 8 once: 4 and 6 win


def test_pads_with_lowest_unused_ids():
    d2t, t2d = build_draft_vocab([torch.tensor([9, 9, 4])], None, target_vocab_size=10, draft_vocab_size=5)
    assert (torch.arange(5) + d2t).tolist() == [0, 1, 2, 4, 9]
    assert int(t2d.sum()) == 5


def test_full_size_is_identity():
    d2t, t2d = build_draft_vocab([torch.tensor([3, 3, 1])], None, target_vocab_size=6, draft_vocab_size=6)
    assert d2t.tolist() == [0] * 6 and bool(t2d.all())


def test_bad_sizes_and_ids_are_one_line_errors():
    with pytest.raises(DraftsmithError, match="draft vocabulary of 11 .* target vocabulary of 10"):
        build_draft_vocab([torch.tensor([1])], None, target_vocab_size=10, draft_vocab_size=11)
    with pytest.raises(DraftsmithError, match="token id 12 is outside the target vocabulary of 10"):
        build_draft_vocab([torch.tensor([1, 12])], None, target_vocab_size=10, draft_vocab_size=4)
    with pytest.raises(DraftsmithError, match="loss mask of 1"):
        build_draft_vocab([torch.tensor([1, 2])], [torch.tensor([1])], target_vocab_size=10, draft_vocab_size=4)
