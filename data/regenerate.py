"""Answer the prompts of a dataset with the target itself.

A drafter is scored on how often it guesses what the *target* says, so it should learn
from the target's replies, not from whoever wrote the dataset: this is the single most
important data step for acceptance. Every assistant turn is replaced, turn by turn: each
user turn is followed by the target's reply to the conversation so far.

Records are appended to a hidden partial file as each batch finishes; a rerun with the
same inputs and settings skips what is done, and the file is renamed to `out_path` only
when complete. The partial's name carries a hash of the inputs and settings, so a rerun
with different ones starts afresh instead of mixing two runs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from draftsmith.data.chat import chat_format, render_text, resolve_template, thinking_kwargs
from draftsmith.data.reply_decoding import ReplyDecoding, stop_token_ids, user_turns
from draftsmith.data.resume import partial_path, resuming
from draftsmith.errors import DiskFull, DraftsmithError
from draftsmith.fsutil import atomic_file, check_not_an_input, full_disk_reason, is_disk_full, write_failure
from draftsmith.logs import show_progress
from draftsmith.processes import Processes
from draftsmith.recipe import DataSection


@dataclass(frozen=True)
class Regeneration:
    """One regeneration's settings, built once where they are read (the command's flags over
    the recipe, or a post-hoc run's recipe) and passed down whole."""

    decoding: ReplyDecoding  # sampling, length, seed; the stop tokens and pad are the target's, added below
    chat_template: str = ""  # a Jinja file or a built-in's name; empty: the tokenizer's
    enable_thinking: bool | None = None  # unset: off where the template has the switch
    servers: tuple[str, ...] = ()  # OpenAI-compatible servers that answer; none: the target in this process
    in_flight: int = 16  # requests in flight per server
    batch_size: int = 8  # in process: prompts answered per generate call


def regeneration(data: DataSection, seed: int, batch_size: int = 8) -> Regeneration:
    """The regeneration a recipe's data section (the command's flags already over it) and seed ask for."""
    decoding = ReplyDecoding(temperature=data.regen_temperature, top_k=data.regen_top_k, top_p=data.regen_top_p,
                             max_new_tokens=data.regen_max_new_tokens, seed=seed)
    return Regeneration(decoding, data.chat_template, data.enable_thinking, tuple(data.regen_servers),
                        data.regen_in_flight, batch_size)


def embedded_conversations(count: int, max_chars: int = 512, split: str = "train") -> list[list[dict]]:
    """Single-turn conversations whose prompts are line-aligned excerpts of the embedded corpus."""
    from draftsmith.data.corpus import corpus_prompts

    return [[{"role": "user", "content": prompt}] for prompt in corpus_prompts(count, max_chars, split)]


@torch.inference_mode()
def _generate(target, tokenizer, prompts: list[str], indices: list[int], template: str | None,
              how: ReplyDecoding) -> list[str]:
    # Left padding keeps every prompt's last token at the end, where generation continues.
    batch = tokenizer(prompts, padding=True, padding_side="left", return_tensors="pt",
                      add_special_tokens=template is None).to(target.device)  # templates write their own BOS
    _check_context(target, batch["attention_mask"].sum(dim=1).tolist(), indices, how.max_new_tokens)
    # Unset fields fall back to the model's generation_config, whose suggested top-k, top-p or
    # repetition penalty would change the distribution the drafters are later measured against.
    sampling = {"do_sample": how.temperature > 0, "repetition_penalty": 1.0}
    if how.temperature > 0:
        sampling |= {"temperature": how.temperature, "top_k": how.top_k, "top_p": how.top_p}
    out = target.generate(**batch, max_new_tokens=how.max_new_tokens, eos_token_id=list(how.stop_ids),
                          pad_token_id=how.pad_id, **sampling)
    replies = []
    for row in out[:, batch["input_ids"].shape[1]:].tolist():
        end = next((k for k, token in enumerate(row) if token in how.stop_ids), len(row))
        replies.append(tokenizer.decode(row[:end], skip_special_tokens=True))
    return replies


def _check_context(target, lengths: list[int], indices: list[int], max_new_tokens: int) -> None:
    """Refuse a prompt the target cannot answer within its positions (it would run, slowly,
    into positions it never learned)."""
    context = getattr(target.config, "max_position_embeddings", None)
    if not context:
        return
    for index, n in zip(indices, lengths):
        if n + max_new_tokens > context:
            raise DraftsmithError(f"conversation {index}: a prompt of {n} tokens with max_new_tokens="
                                  f"{max_new_tokens} exceeds the target's context of {context}")


def _answer(target, tokenizer, batch: list[list[dict]], first_index: int, template: str | None,
            how: ReplyDecoding, template_kwargs: dict) -> list[list[dict]]:
    """The conversations of one batch with every assistant turn written by the target."""
    turns = [user_turns(messages, first_index + k) for k, messages in enumerate(batch)]
    histories: list[list[dict]] = [[] for _ in batch]
    for t in range(max(len(conv) for conv in turns)):
        active = [k for k, conv in enumerate(turns) if t < len(conv)]
        for k in active:
            histories[k] += turns[k][t]
        prompts = [render_text(tokenizer, histories[k], template, add_generation_prompt=template is not None,
                               template_kwargs=template_kwargs) for k in active]
        replies = _generate(target, tokenizer, prompts, [first_index + k for k in active], template, how)
        for k, reply in zip(active, replies):
            histories[k].append({"role": "assistant", "content": reply})
    return histories


def _rank_file(base: Path, rank: int, world: int) -> Path:
    """The partial file process `rank` of `world` appends its batches to."""
    return base if world == 1 else base.with_name(f"{base.name}.rank{rank}of{world}")


def regenerate(target, tokenizer, conversations: list[list[dict]], out_path: str | Path, how: ReplyDecoding,
               batch_size: int = 8, chat_template: str | None = None, untemplated: bool = False,
               processes: Processes | None = None, enable_thinking: bool | None = None) -> Path:
    """Write `conversations` to `out_path` (JSON Lines of `{"messages": [...]}`) with target replies.

    `how.temperature` 0 decodes greedily; above 0 it samples from the target's distribution at
    that temperature, restricted by `top_k` (0: off) and `top_p` (1: off), seeded per batch
    from `how.seed`, so the same seed gives the same file; replies are at most
    `how.max_new_tokens` long and end at the target's stop tokens. `untemplated=True`
    prompts with the concatenated contents instead of the chat template (see data/chat.py).
    `chat_template` is template text (None: the tokenizer's); `enable_thinking` reaches
    templates with the switch (unset: off; see `thinking_kwargs`).
    `processes` (draftsmith/processes.py) deals the batches to the processes of a launch, each
    writing its own partial file; the main process merges them into `out_path`.
    """
    out_path = Path(out_path)
    if not conversations:
        raise DraftsmithError("regenerate: no conversations given")
    if batch_size < 1:
        raise DraftsmithError(f"regenerate: batch_size ({batch_size}) must be positive")
    template = None if untemplated else resolve_template(tokenizer, chat_template)
    template_kwargs = thinking_kwargs(template, enable_thinking)
    how = how.ending(stop_token_ids(target.generation_config, tokenizer, chat_template, untemplated, template_kwargs),
                     tokenizer)
    for index, messages in enumerate(conversations):  # a bad record fails before a partial file exists
        user_turns(messages, index)
    # The embedding sum tells a retrained target from the one that wrote an old partial file.
    weights = float(target.get_input_embeddings().weight.detach().double().sum())
    base = partial_path(out_path, [getattr(target, "name_or_path", ""), weights, conversations, how.max_new_tokens,
                                   how.temperature, how.seed, batch_size, template, how.top_p, how.top_k]
                        + ([template_kwargs] if template_kwargs else []))  # the key of older runs stays
    procs = processes or Processes()
    total = len(conversations)
    starts = [s for s in range(0, total, batch_size) if procs.mine(s // batch_size)]
    mine = sum(min(batch_size, total - s) for s in starts)
    partial = _rank_file(base, procs.rank, procs.world)
    with resuming(partial, batch_size, mine) as done:
        # Whole batches are done, or all of this process's (its last batch may be short).
        todo = starts[len(starts) if done >= mine else done // batch_size:]
        try:
            _append_batches(target, tokenizer, conversations, partial, done, template, how, batch_size, todo, mine,
                            show=procs.main, template_kwargs=template_kwargs)
        except Exception as exc:
            if not is_disk_full(exc):
                raise
            raise DiskFull(f"cannot write {partial}: {write_failure(exc)} ({full_disk_reason(exc)}); the answers "
                           "written before are kept there: rerun the same command to resume") from None
    if procs.world == 1:
        os.replace(partial, out_path)
        return out_path
    procs.barrier()
    if procs.main:
        _merge_processes(base, procs.world, batch_size, total, out_path)
    procs.barrier()
    return out_path


def _merge_processes(base: Path, world: int, batch_size: int, total: int, out_path: Path) -> None:
    """The processes' partial files as one, batch b taken from process b % world."""
    parts = [_rank_file(base, r, world) for r in range(world)]
    lines = [part.read_bytes().splitlines(keepends=True) for part in parts]
    taken, merged = [0] * world, []
    for b, start in enumerate(range(0, total, batch_size)):
        r, size = b % world, min(batch_size, total - start)
        merged += lines[r][taken[r]:taken[r] + size]
        taken[r] += size
    if taken != [len(part) for part in lines]:
        raise DraftsmithError(f"regenerate: the processes' files {parts[0].name} ... hold {[len(x) for x in lines]} "
                              f"records, not the {taken} of their batches")
    with atomic_file(out_path, "wb") as handle:
        handle.write(b"".join(merged))
    for part in parts:
        part.unlink()


def _append_batches(target, tokenizer, conversations, partial: Path, done: int, template: str | None,
                    how: ReplyDecoding, batch_size: int, starts: list[int], total: int, show: bool = True,
                    template_kwargs: dict | None = None) -> None:
    with partial.open("a", encoding="utf-8") as handle, \
            tqdm(total=total, initial=done, desc="regenerate", unit="conv",
                 disable=not show or not show_progress()) as bar:
        for start in starts:
            batch = conversations[start:start + batch_size]
            with torch.random.fork_rng(devices=[target.device] if target.device.type == "cuda" else []):
                torch.manual_seed(how.seed + start)
                answered = _answer(target, tokenizer, batch, start, template, how, template_kwargs or {})
            handle.write("".join(json.dumps({"messages": m}, ensure_ascii=False) + "\n" for m in answered))
            handle.flush()
            os.fsync(handle.fileno())
            bar.update(len(batch))


def regenerate_command(target: str, out: str, settings: Regeneration, data: DataSection, limit: int | None = None,
                       target_name: str = "") -> Path:
    """`draftsmith data regenerate`: a target folder (with its tokenizer) answers the conversations
    of `data.dataset` (its config, split and columns), at most `limit`; "embedded": `limit`
    (default 256) excerpts of the embedded corpus, which the target continues as plain text, as
    it was pretrained. Servers may list the target as `target_name` or its folder."""
    from draftsmith.data.conversations import load_conversations
    from draftsmith.data.tokenizer import load_pretrained_tokenizer

    embedded = data.dataset == "embedded"
    check_not_an_input(out, {"--dataset": None if embedded else data.dataset, "--target": target})  # before any answer
    tokenizer = load_pretrained_tokenizer(target)

    def conversations() -> list[list[dict]]:
        if not embedded:
            return load_conversations(data.dataset, limit, config=data.dataset_config, split=data.dataset_split,
                                      columns=data.columns)
        if limit is not None and limit < 1:
            raise DraftsmithError(f"regenerate: --limit must be at least 1, got {limit}")
        return embedded_conversations(256 if limit is None else limit)

    return run_regeneration(settings, target, tokenizer, conversations, out, untemplated=embedded, names=(target_name,))


def run_regeneration(settings: Regeneration, target_dir: str | Path, tokenizer,
                     conversations: Callable[[], list[list[dict]]], out: str | Path, untemplated: bool,
                     names: tuple[str, ...] = (), model=None) -> Path:
    """Answer `conversations()` into `out`: the one choice of who answers. With servers, they do
    (the target, which they may list under `names` or its folder, is not loaded here); else
    the target in this process (`model`, else loaded), every process of a launch its share.
    The chat template is read before the conversations, so a bad one fails first."""
    from draftsmith.processes import current_processes

    template, template_kwargs = chat_format(tokenizer, settings.chat_template, settings.enable_thinking, untemplated=untemplated)
    asked = conversations()
    if settings.servers:
        from draftsmith.data.regen_server import decoding_for, regenerate_via_servers
        from draftsmith.data.server_endpoint import Limits

        how = decoding_for(target_dir, tokenizer, settings.decoding, untemplated, template, template_kwargs)
        return regenerate_via_servers(list(settings.servers), tuple(n for n in (*names, str(target_dir)) if n),
                                      tokenizer, asked, out, how, untemplated=untemplated,
                                      limits=Limits(in_flight=settings.in_flight), template_kwargs=template_kwargs)
    processes = current_processes()
    if model is None:
        from draftsmith.data.tokenizer import check_fits
        from draftsmith.models.target import load_target

        model = load_target(target_dir, device=processes.device or ("cuda" if torch.cuda.is_available() else None))
        check_fits(tokenizer, model.get_input_embeddings().num_embeddings, target_dir, target_dir)
    return regenerate(model, tokenizer, asked, out, settings.decoding, batch_size=settings.batch_size,
                      chat_template=template, untemplated=untemplated, processes=processes,
                      enable_thinking=template_kwargs.get("enable_thinking"))
