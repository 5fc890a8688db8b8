"""How a regenerated reply is decoded (`ReplyDecoding`: the sampling, its length, seed and
stop tokens) and which turns of a conversation the target answers; shared by the in-process
path (data/regenerate.py) and the servers' (data/regen_server.py), in a module that imports
no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from draftsmith.data.chat import end_of_turn_ids
from draftsmith.errors import DraftsmithError
from draftsmith.sampling_params import SamplingParams


@dataclass(frozen=True)
class ReplyDecoding(SamplingParams):
    """How both paths decode a reply: the sampling, plus its length, seed and stop tokens."""
    max_new_tokens: int = 1
    seed: int = 0
    stop_ids: tuple[int, ...] = ()  # the target's end-of-text and the template's end of turn
    pad_id: int = 0

    def __post_init__(self):
        super().__post_init__()
        if self.max_new_tokens < 1:
            raise DraftsmithError(f"regenerate: max_new_tokens ({self.max_new_tokens}) must be positive")

    def ending(self, stop_ids: list[int], tokenizer) -> ReplyDecoding:
        """These settings ending a reply at `stop_ids`, padded with the tokenizer's pad (else the first stop)."""
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
        return replace(self, stop_ids=tuple(stop_ids), pad_id=pad)


def stop_token_ids(generation_config, tokenizer, chat_template: str | None = None, untemplated: bool = False,
                   template_kwargs: dict | None = None) -> list[int]:
    """Where a reply ends: the target's and tokenizer's end-of-text ids and the template's end of turn."""
    ids = generation_config.eos_token_id
    ids = set([ids] if isinstance(ids, int) else ids or [])
    ids |= {tokenizer.eos_token_id} - {None}
    if not untemplated:
        ids |= set(end_of_turn_ids(tokenizer, chat_template, template_kwargs))
    return sorted(ids)


def user_turns(messages: list[dict], index: int) -> list[list[dict]]:
    """The conversation without its assistant turns, cut after each user turn."""
    turns, pending = [], []
    for message in messages:
        if message["role"] == "assistant":
            continue
        pending.append(message)
        if message["role"] == "user":
            turns.append(pending)
            pending = []
    if not turns:
        raise DraftsmithError(f"conversation {index} has no user turn to answer")
    return turns
