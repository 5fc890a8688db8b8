"""The target as its own drafter: greedy drafts are exactly what the target would say,
so every draft is accepted and tau = 1 + D. A correctness probe for the decoder, and the
upper bound a drafter could reach at a given D."""

from __future__ import annotations

from draftsmith.eval.proposers.draft_lm import DraftLMProposer


class OracleProposer(DraftLMProposer):
    def __init__(self, target):
        super().__init__(target, target, name="oracle")
