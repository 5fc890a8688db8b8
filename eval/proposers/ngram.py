"""Prompt lookup: draft by copying what followed the latest earlier occurrence of the
context's last n tokens (n from `max_ngram` down to `min_ngram`). No model, no training.

An index from each n-gram to the position right after its latest occurrence is updated
as tokens are committed, so a proposal costs a few dictionary look-ups however long the
context. The n-gram ending at the last token is indexed only once another token follows
it, so a look-up never finds the tail itself.

A copy that reaches the end of the context continues into the tokens it has just copied
(the periodic extension of a repeat), so a loop of period p still yields a full draft.
`latest=False, extend=False` is transformers' policy instead (earliest match, the copy
stops at the end of the context), for engine-to-engine comparisons on equal drafts.
"""

from __future__ import annotations

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.eval.proposers.base import Draft, Proposer


class NgramProposer(Proposer):
    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, latest: bool = True, extend: bool = True):
        if not 1 <= min_ngram <= max_ngram:
            raise DraftsmithError(f"n-gram drafter: need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.name = "ngram"
        self.sizes = range(max_ngram, min_ngram - 1, -1)  # longest match first
        self.latest, self.extend = latest, extend
        self.tokens: list[int] = []
        self.next_after: dict[tuple[int, ...], int] = {}

    def begin(self, prompt_ids, ctx) -> None:
        self.tokens, self.next_after = [], {}
        self._append(prompt_ids.tolist())

    def commit(self, accepted, ctx) -> None:
        self._append(accepted.tolist())

    def _append(self, new: list[int]) -> None:
        tokens = self.tokens
        for token in new:
            end = len(tokens)
            for n in self.sizes:
                if n <= end:
                    key = tuple(tokens[end - n : end])
                    if self.latest or key not in self.next_after:
                        self.next_after[key] = end
            tokens.append(token)

    def propose(self, max_nodes, sampling, generator) -> Draft:
        tokens = self.tokens
        for n in self.sizes:
            start = self.next_after.get(tuple(tokens[-n:])) if n <= len(tokens) else None
            if start is not None and max_nodes > 0:
                if not self.extend:
                    return Draft(torch.tensor(tokens[start : start + max_nodes], dtype=torch.long))
                out: list[int] = []
                for j in range(start, start + max_nodes):
                    out.append(tokens[j] if j < len(tokens) else out[j - len(tokens)])
                return Draft(torch.tensor(out, dtype=torch.long))
        return Draft.empty()


def load_proposer(path, target, **options) -> NgramProposer:
    return NgramProposer(**options)


def vllm_config(path, num_draft: int, options: dict) -> tuple[dict, str]:
    """vLLM's prompt lookup at our n-gram sizes. vLLM takes the earliest match of the longest
    n-gram and stops the copy at the context's end (v1/spec_decode/ngram_proposer.py): our
    `ngram_earliest`; where the row drafts otherwise, the note says so."""
    proposer = NgramProposer(**options)
    config = {"method": "ngram", "num_speculative_tokens": num_draft,
              "prompt_lookup_max": max(proposer.sizes), "prompt_lookup_min": min(proposer.sizes)}
    same = not proposer.latest and not proposer.extend
    return config, "" if same else ("vLLM copies after the earliest match and stops at the context's end; this row "
                                    "copies after the latest and extends a repeat (ngram_earliest drafts as vLLM)")
