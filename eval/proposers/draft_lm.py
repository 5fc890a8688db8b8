"""An external draft model: any Hugging Face causal LM with the target's vocabulary.

It keeps its own KV cache with the same invariant as the target's: committed tokens it
has already read, plus `pending` ones (committed, not yet fed). A proposal feeds the
pending tokens, then its own drafts one at a time; `commit` crops the cache back to the
committed tokens it holds, keeping the KV of drafts that were accepted.
"""

from __future__ import annotations

import torch

from draftsmith.errors import DraftsmithError, first_lines
from draftsmith.eval.proposers.base import Draft, Proposer, SamplingParams
from draftsmith.eval.sampling import draw
from draftsmith.fsutil import read_json
from draftsmith.models.target import target_forward
from draftsmith.models.target_cache import crop_cache, new_cache


class DraftLMProposer(Proposer):
    def __init__(self, model, target, name: str = "draft-lm"):
        draft_vocab, target_vocab = model.config.vocab_size, getattr(target, "config", target).vocab_size
        if draft_vocab != target_vocab:
            raise DraftsmithError(
                f"draft model {name}: vocabulary of {draft_vocab} tokens, the target has {target_vocab}; "
                "a draft model must share the target's tokenizer"
            )
        self.name = name
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.cache = None
        self.pending = torch.empty(0, dtype=torch.long)
        self.drafts_fed: int | None = None  # drafts whose KV the last proposal left in the cache

    def begin(self, prompt_ids, ctx) -> None:
        self.cache = new_cache(self.model)
        self.pending = prompt_ids.to(self.device)
        self.drafts_fed = None

    @torch.no_grad()
    def propose(self, max_nodes: int, sampling: SamplingParams, generator) -> Draft:
        if max_nodes <= 0:
            return Draft.empty(self.device)
        tokens, probs = [], []
        step_input = self.pending
        for _ in range(max_nodes):
            logits = target_forward(self.model, step_input[None], cache=self.cache, logits_to_keep=1).logits[0, -1]
            token, q = draw(logits, sampling, generator)
            if q is not None:
                probs.append(q)
            tokens.append(token)
            step_input = token.reshape(1)
        self.drafts_fed = max_nodes - 1  # the last draft was never fed back
        return Draft(torch.stack(tokens), None, torch.stack(probs) if probs else None)

    def commit(self, accepted, ctx) -> None:
        accepted = accepted.to(self.device)
        if self.drafts_fed is None:  # no proposal since the last commit: nothing was fed
            self.pending = torch.cat([self.pending, accepted])
            return
        kept = min(len(accepted) - 1, self.drafts_fed)
        crop_cache(self.cache, self.cache.get_seq_length() - self.drafts_fed + kept)
        self.pending = accepted[kept:]
        self.drafts_fed = None


def vllm_config(path, num_draft: int, options: dict) -> tuple[dict, str]:
    """vLLM serves a draft model from its own Hugging Face folder (`method: draft_model`)."""
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": num_draft}, ""


def load_proposer(path, target, **options) -> DraftLMProposer:
    from transformers import AutoModelForCausalLM

    if not (path / "config.json").is_file():
        raise DraftsmithError(f"draft model {path}: no config.json (expected a draft_lm run or a HF model folder)")
    meta = read_json(path / "config.json")
    if meta.get("format") == "draftsmith":  # a native drafter of another method, not a causal LM
        raise DraftsmithError(f"draft model {path} is a {meta.get('method')} drafter, not a causal LM "
                              f"(use --drafter {meta.get('method')}:{path})")
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path))
    except Exception as exc:  # a corrupt or foreign folder: its files, not our bug
        raise DraftsmithError(f"draft model {path}: cannot load it as a causal LM: {first_lines(exc)}") from None
    model = model.to(next(target.parameters()).device)
    return DraftLMProposer(model, target, name="draft_lm")
