"""Decoding the evaluated prompts: the embedded default's prompts, a conversation dataset's
turns rendered as they are decoded, each prompt seeded and decoded by a SpeculativeDecoder,
and the per-prompt statistics merged. `draftsmith eval` (eval/evaluate.py) and `--num-draft
auto`'s calibration (eval/auto_draft.py) both decode through these.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.eval.decoder import DecodeStats
from draftsmith.eval.settings import EvalSettings


def prompt_ids(tokenizer, settings: EvalSettings, context: int, count: int | None = None, split: str = "test",
               which: str = "prompt") -> list[torch.Tensor]:
    """Token ids of the embedded default's prompts: held-out corpus prefixes as plain text
    (`count` of them, default settings.num_prompts, from the corpus's `split`)."""
    from draftsmith.data.corpus import corpus_prompts

    count = count or settings.num_prompts
    texts = corpus_prompts(count * pool_factor(settings), max_chars=settings.prompt_chars, split=split)
    ids = long_enough([tokenizer(t, add_special_tokens=True)["input_ids"] for t in texts], count, settings,
                      f"held-out excerpts of {settings.prompt_chars} characters (--prompt-chars)")
    for i, row in enumerate(ids):
        _check_context(row, settings, context, f"{which} {i}")
    return [torch.tensor(row, dtype=torch.long) for row in ids]


# With --min-prompt-tokens, prompts are drawn from this many times as many candidates.
LONG_PROMPT_POOL = 8


def pool_factor(settings: EvalSettings) -> int:
    return LONG_PROMPT_POOL if settings.min_prompt_tokens else 1


def long_enough(rows: list, count: int, settings: EvalSettings, what: str, length=len) -> list:
    """The first `count` of `rows` whose `length` is at least --min-prompt-tokens; too few is one line."""
    kept = [row for row in rows if length(row) >= settings.min_prompt_tokens][:count]
    if len(kept) < count:
        raise DraftsmithError(f"--min-prompt-tokens {settings.min_prompt_tokens}: {len(kept)} of {len(rows)} {what} "
                              f"are that long, fewer than the {count} asked for")
    return kept


def _check_context(row: list[int], settings: EvalSettings, context: int, which: str) -> None:
    if len(row) + settings.max_new_tokens > context:
        raise DraftsmithError(f"dataset {settings.dataset}: {which} has {len(row)} tokens; with "
                              f"max_new_tokens={settings.max_new_tokens} that exceeds the target's context "
                              f"(less the drafts of a verify pass) of {context}")


@dataclass
class Conversations:
    """A conversation dataset and how its turns are rendered (eval/prompts.py)."""
    turns: list  # EvalConversation per conversation
    tokenizer: object
    template: str | None
    template_kwargs: dict
    context: int  # positions a prompt and its answer may fill

    def longest(self, settings: EvalSettings) -> int:
        """A bound on the longest prompt, known before any answer is: every turn with an empty
        answer, plus max_new_tokens (and slack for re-tokenizing the answer's text) per turn."""
        from draftsmith.eval.prompts import render_turn

        bounds = []
        for turns in self.turns:
            history = [m for asked in turns for m in (*asked, {"role": "assistant", "content": ""})][:-1]
            rendered = len(render_turn(self.tokenizer, history, self.template, self.template_kwargs))
            bounds.append(rendered + (len(turns) - 1) * (settings.max_new_tokens + 8))
        return min(max(bounds), self.context)

    def prompt(self, history: list[dict], settings: EvalSettings, which: str) -> torch.Tensor:
        from draftsmith.eval.prompts import render_turn

        row = render_turn(self.tokenizer, history, self.template, self.template_kwargs)
        _check_context(row, settings, self.context, which)
        return torch.tensor(row, dtype=torch.long)


def decode_conversations(decoder, data: Conversations, settings, sampling, progress: str):
    """Every user turn of every conversation decoded in order, each after the decoder's own
    answers to the turns before it: (prompts, per-prompt stats, outputs), flat, in the
    order `decode_prompts` then replays them (prompt i seeded with seed + i)."""
    from tqdm.auto import tqdm

    prompts, per_prompt, outputs = [], [], []
    total = sum(len(turns) for turns in data.turns)
    with tqdm(total=total, desc=progress, leave=False, dynamic_ncols=True) as bar:
        for c, turns in enumerate(data.turns):
            history: list[dict] = []
            for t, asked in enumerate(turns):
                history += asked
                prompt = data.prompt(history, settings, f"conversation {c} turn {t + 1}")
                generator = torch.Generator(device=decoder.device).manual_seed(settings.seed + len(prompts))
                result = decoder.generate(prompt, settings.max_new_tokens, sampling, generator)
                tokens = result.tokens.tolist()
                prompts.append(prompt)
                outputs.append(tokens)
                per_prompt.append(result.stats)
                answer = tokens[:stop_at(tokens, decoder.eos)]
                history.append({"role": "assistant",
                                "content": data.tokenizer.decode(answer, skip_special_tokens=True)})
                bar.update(1)
    return prompts, per_prompt, outputs


def decode_prompts(decoder, prompts, settings, sampling, progress: str):
    """Each prompt decoded with its own seed: (per-prompt stats, outputs)."""
    from tqdm.auto import tqdm

    per_prompt, outputs = [], []
    for i, prompt in enumerate(tqdm(prompts, desc=progress, leave=False, dynamic_ncols=True)):
        generator = torch.Generator(device=decoder.device).manual_seed(settings.seed + i)
        result = decoder.generate(prompt, settings.max_new_tokens, sampling, generator)
        outputs.append(result.tokens.tolist())
        per_prompt.append(result.stats)
    return per_prompt, outputs


def merge_stats(stats: list[DecodeStats]) -> DecodeStats | None:
    """One DecodeStats summing those given (None for none)."""
    merged = None
    for s in stats:
        merged = s if merged is None else merged.merge(s)
    return merged


def per_pass_ms(stats: DecodeStats, seconds: float) -> float:
    return 1000.0 * seconds / max(1, stats.verify_passes)


def tokens_per_s(stats: DecodeStats, outputs: list[list[int]]) -> float:
    return sum(len(o) for o in outputs) / max(stats.total_s, 1e-9)


def stop_at(tokens, stop) -> int:
    """The index of the first of `stop` in `tokens` (its length where none is): an answer is
    `tokens[:stop_at(...)]`, and `+ 1` keeps the stop token."""
    return next((k for k, token in enumerate(tokens) if token in stop), len(tokens))
