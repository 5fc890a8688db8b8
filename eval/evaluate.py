"""`draftsmith eval`: every drafter against plain decoding of the same target, on the same
prompts, with the same settings, in one run; then the report.

A conversation dataset is decoded turn by turn (eval/prompts.py): every user turn is a
prompt, the second asked after plain decoding's answer to the first, as Spec-Bench and EAGLE
score MT-bench. Every drafter then decodes those same prompts: at temperature 0 its answers
are plain decoding's token for token, so this is each method answering its own turns; when
sampling, the prompts stay identical across methods (the references let each method go on
from its own sample, which has the same distribution).

At temperature 0 each drafter's output is also checked token for token against plain
decoding: a mismatch is a bug in a drafter or the decoder, and the run stops.
"""

from __future__ import annotations

from pathlib import Path

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.eval.auto_draft import calibration_prompts, choose, plan_auto
from draftsmith.eval.decoder import CACHE_KINDS, SpeculativeDecoder
from draftsmith.eval.decoding import (
    Conversations,
    decode_conversations,
    decode_prompts,
    long_enough,
    merge_stats,
    per_pass_ms,
    pool_factor,
    prompt_ids,
    tokens_per_s,
)
from draftsmith.eval.proposers import parse_drafter_arg, proposer_from_arg
from draftsmith.eval.proposers.base import NoProposer, SamplingParams
from draftsmith.eval.report import (
    PLAIN,
    check_report_dest,
    distinct_4gram_ratio,
    format_table,
    loops,
    setting_label,
    setting_name,
    speedup_bound,
    temperature_label,
    write_index,
    write_report,
)
from draftsmith.eval.settings import AUTO, NUM_DRAFT_WORDS, EvalSettings
from draftsmith.fsutil import atomic_dir
from draftsmith.models.latency import PAST_TILE
from draftsmith.models.model_dir import find_model_dir
from draftsmith.models.tile import plan_tile, read_target_config


def evaluate(target_path: str | Path, settings: EvalSettings, out_dir: str | Path) -> list[dict]:
    """One report per temperature; with several, each in its own subfolder `t<temperature>`
    and an index `report.md` with their tables. The folder is written whole or not at all."""
    from draftsmith.data.tokenizer import check_fits, load_pretrained_tokenizer
    from draftsmith.models.target import load_target

    if not settings.drafters:
        raise DraftsmithError("eval: give at least one --drafter")
    if settings.cache_kind not in CACHE_KINDS:
        raise DraftsmithError(f"eval: --cache must be one of {', '.join(CACHE_KINDS)}, got {settings.cache_kind!r}")
    if settings.compile and settings.cache_kind != "static":
        raise DraftsmithError("eval: --compile needs --cache static (a compiled graph replays fixed shapes at fixed "
                              "addresses)")
    check_report_dest(out_dir)  # cheap checks before any model is loaded
    engine = None
    if settings.engine:
        from draftsmith.eval.engine import check_engine

        engine = check_engine(settings)
    if settings.max_new_tokens < 1 or settings.num_prompts < 1:
        raise DraftsmithError(f"eval: --max-new-tokens ({settings.max_new_tokens}) and --num-prompts "
                              f"({settings.num_prompts}) must be at least 1")
    if settings.min_prompt_tokens < 0:
        raise DraftsmithError(f"eval: --min-prompt-tokens must be 0 (off) or a length, got {settings.min_prompt_tokens}")
    auto = settings.num_draft == AUTO
    if auto and settings.calibration_prompts < 1:
        raise DraftsmithError(f"eval: --calibration-prompts must be at least 1, got {settings.calibration_prompts}")
    if not auto and settings.latency_table:
        raise DraftsmithError("eval: --latency-table prices the passes of --num-draft auto; give both or neither")
    if not auto and settings.num_draft is not None and settings.num_draft < 1:
        raise DraftsmithError(f"eval: --num-draft must be {NUM_DRAFT_WORDS}; got {settings.num_draft}")
    for arg in settings.drafters:
        parse_drafter_arg(arg)
    labels: dict[str, float] = {}
    for t in settings.each_temperature():
        settings.sampling(t)  # validates
        label = temperature_label(t)
        if label in labels:  # its report would replace the first's
            raise DraftsmithError(f"eval: --temperature {labels[label]:g} and --temperature {t!r} are one setting "
                                  f"(report folder {label}): give each temperature once")
        labels[label] = t
    folder = find_model_dir(target_path, require="target")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target = load_target(folder, device=device)
    tokenizer = load_pretrained_tokenizer(folder)
    check_fits(tokenizer, target.get_input_embeddings().num_embeddings, folder, folder)
    plan = plan_tile(read_target_config(folder), tile=settings.tile)
    # auto: room for the largest D the choice may return (eval/auto_draft.py caps it there)
    num_draft = plan.D + PAST_TILE if auto else plan.D if settings.num_draft is None else settings.num_draft
    # A verify pass writes num_draft positions past the last committed token.
    context = target.config.max_position_embeddings - num_draft
    source, eos = _source(target, tokenizer, settings, context)
    auto_plan = _plan_auto(target, plan, settings, source, tokenizer, context, num_draft, eos) if auto else None
    proposers = [proposer_from_arg(arg, target, settings.proposer_options)  # fail before any decoding
                 for arg in settings.drafters]

    runs = []
    for temperature in settings.each_temperature():
        sampling = settings.sampling(temperature)
        results = _run(target, proposers, source, settings, sampling, num_draft, eos, auto_plan)
        # The name the user gave (a hub or embedded name, a GGUF file) beside the folder it resolved to.
        results["target"] = {"path": str(folder), "name": str(target_path), "H": plan.H, "KV": plan.KV, "G": plan.G,
                             "tile": plan.tile, "D": plan.D if auto else num_draft}
        runs.append(results)
    if engine:  # the serving engine on the same prompts, beside each row (eval/engine.py)
        from draftsmith.eval.engine import add_engine_columns

        add_engine_columns(runs, settings, folder, engine)
    if len(runs) == 1:
        write_report(runs[0], out_dir)
    else:
        with atomic_dir(out_dir) as tmp:
            for results in runs:
                write_report(results, tmp / setting_label(results))
            write_index([(setting_label(r), r) for r in runs], tmp)
    return runs


def _plan_auto(target, plan, settings: EvalSettings, source, tokenizer, context: int, room: int, eos=None):
    """The calibration prompts and the latency table of --num-draft auto (eval/auto_draft.py)."""
    import logging

    prompts, split = calibration_prompts(settings, source, tokenizer, context, target, eos)
    log = logging.getLogger(__name__)
    auto = plan_auto(target, plan, prompts, split, settings.max_new_tokens, settings.latency_table, log.info)
    auto.cap = min(auto.cap, room)
    return auto


def _source(target, tokenizer, settings: EvalSettings, context: int):
    """What is decoded, and the tokens that end an answer (None: the target's own): the
    embedded prompts as plain text, or a conversation dataset's turns through the chat
    template, ended by the template's end of turn as well (a served chat model stops there)."""
    from draftsmith.data.chat import chat_format
    from draftsmith.data.reply_decoding import stop_token_ids
    from draftsmith.eval.prompts import eval_conversations, render_turn

    if settings.dataset == "embedded":
        chat_format(tokenizer, settings.chat_template, settings.enable_thinking, untemplated=True)  # refuses a switch
        return prompt_ids(tokenizer, settings, context), None
    untemplated = not (settings.chat_template or tokenizer.chat_template)
    template, kwargs = chat_format(tokenizer, settings.chat_template, settings.enable_thinking, untemplated=untemplated)
    turns = eval_conversations(settings.dataset, settings.num_prompts * pool_factor(settings))
    if settings.min_prompt_tokens:  # judged by the first turn's prompt, rendered as it is decoded
        first = lambda conversation: len(render_turn(tokenizer, conversation[0], template, kwargs))  # noqa: E731
        turns = long_enough(turns, settings.num_prompts, settings, f"conversations of {settings.dataset}", first)
    stops = stop_token_ids(target.generation_config, tokenizer, template, untemplated, kwargs)
    return Conversations(turns, tokenizer, template, kwargs, context), tuple(stops)


def _run(target, proposers, source, settings: EvalSettings, sampling: SamplingParams, num_draft: int,
         eos: tuple[int, ...] | None = None, auto=None) -> dict:
    """Plain decoding, then each drafter, on the same prompts with the same settings. With
    `auto` (eval/auto_draft.py: AutoPlan) each drafter's D is chosen first; `num_draft` is
    then the most any may get."""
    conversations = source if isinstance(source, Conversations) else None
    first = conversations.prompt(conversations.turns[0][0], settings, "conversation 0 turn 1") \
        if conversations else source[0]
    decoder_options = {"cache_kind": settings.cache_kind, "compile": settings.compile, "eos_token_id": eos}
    if settings.cache_kind == "static":  # one size for every prompt: a compiled graph is traced for it once
        longest = conversations.longest(settings) if conversations else max(len(p) for p in source)
        decoder_options["max_cache_len"] = longest + settings.max_new_tokens + num_draft
    # First calls pay one-off costs; with compile, CUDA graphs trace, then record, then replay.
    warm_ups = 3 if settings.compile else 1
    plain_decoder = SpeculativeDecoder(target, NoProposer(), num_draft=0, **decoder_options)
    for _ in range(warm_ups):
        plain_decoder.generate(first[:8], 4, sampling)
    if conversations:  # the later turns' prompts hold plain decoding's answers to the earlier ones
        prompts, base_runs, base_out = decode_conversations(plain_decoder, conversations, settings, sampling,
                                                            "plain decoding")
    else:
        prompts = source
        base_runs, base_out = decode_prompts(plain_decoder, prompts, settings, sampling, "plain decoding")
    base_stats = merge_stats(base_runs)
    t_target = per_pass_ms(base_stats, base_stats.verify_s)
    base_tps = tokens_per_s(base_stats, base_out)
    # Which prompts' plain text loops: there tau measures copying the loop (report.loops).
    looping = [loops(o) for o in base_out]
    steps: dict[str, list[list[int]]] = {}
    accepted: dict[str, list[list[int]]] = {}  # per prompt, the drafts each verify pass kept

    rows, outputs = [], {PLAIN: base_out}
    unique = len({p.name for p in proposers}) == len(proposers)
    for arg, proposer in zip(settings.drafters, proposers):
        chosen, auto_row = num_draft, None
        if auto is not None:
            calibrating = proposer_from_arg(arg, target, settings.proposer_options)  # its own counters
            plain_host = per_pass_ms(base_stats, base_stats.other_s)
            chosen, auto_row = choose(calibrating, lambda p, d: SpeculativeDecoder(target, p, num_draft=d, **decoder_options),
                                      auto, sampling, settings, plain_host)
            proposer.set_options(**auto_row.get("options", {}))  # its tuning's, chosen with D
        decoder = SpeculativeDecoder(target, proposer, num_draft=chosen, **decoder_options)
        for _ in range(warm_ups):
            decoder.generate(prompts[0][:8], 4, sampling)
        runs, out = decode_prompts(decoder, prompts, settings, sampling, f"{arg} t={sampling.temperature:g}")
        stats = merge_stats(runs)
        no_loop = merge_stats([r for r, loop in zip(runs, looping) if not loop])
        if sampling.greedy:
            for i, (mine, plain) in enumerate(zip(out, base_out)):
                if mine != plain:
                    raise DraftsmithError(f"lossless check failed: drafter {arg} changed the greedy output of prompt {i}")
        tps = tokens_per_s(stats, out)
        t_draft, t_verify = per_pass_ms(stats, stats.draft_s), per_pass_ms(stats, stats.verify_s)
        row = {
            "name": proposer.name if unique else arg,
            "drafter": arg, "weights": proposer.weights, "num_draft": chosen, "tau": stats.tau,
            "tau_no_loop": no_loop.tau if no_loop is not None else None,
            "verify_passes": stats.verify_passes, "committed_tokens": stats.committed,
            "per_position_acceptance": stats.per_position_acceptance,
            "accepted_length_hist": list(stats.accepted_hist),
            "tokens_per_s": tps, "speedup": tps / max(base_tps, 1e-9),
            "bound": speedup_bound(stats.tau, t_target, t_draft, t_verify),
            "T_draft_ms": t_draft, "T_verify_ms": t_verify,
        }
        extra = proposer.report_extra()
        if extra:
            row["extra"] = extra
        if auto_row is not None:
            row["num_draft_auto"] = auto_row
        rows.append(row)
        outputs[row["name"]] = out
        steps[row["name"]] = [[r.committed, r.verify_passes] for r in runs]
        accepted[row["name"]] = [r.accepted_steps for r in runs]

    chat = {}
    if conversations:  # how the prompts were rendered: what a published table must match
        chat = {"conversations": len(conversations.turns), "chat_template": settings.chat_template or "the tokenizer's",
                "enable_thinking": conversations.template_kwargs.get("enable_thinking")}
    results = {
        "settings": {"dataset": settings.dataset, "num_prompts": len(prompts), "max_new_tokens": settings.max_new_tokens,
                     "temperature": sampling.temperature, "top_k": settings.top_k, "top_p": settings.top_p,
                     "seed": settings.seed, "cache": settings.cache_kind, "compile": settings.compile,
                     "min_prompt_tokens": settings.min_prompt_tokens,
                     "stop_token_ids": sorted(plain_decoder.eos), **chat},
        PLAIN: {"tokens_per_s": base_tps, "T_target_ms": t_target,
                "distinct_4gram": distinct_4gram_ratio(base_out), "looping_prompts": sum(looping)},
        "drafters": rows,
        "prompts": [{"prompt_ids": p.tolist(), "outputs": {name: o[i] for name, o in outputs.items()},
                     "loops": looping[i], "steps": {name: s[i] for name, s in steps.items()},
                     "accepted": {name: a[i] for name, a in accepted.items()}}
                    for i, p in enumerate(prompts)],
    }
    if auto is not None:
        results["num_draft_auto"] = auto.describe()
    return results


def print_summary(runs: list[dict], out_dir) -> None:
    for results in runs:
        print(f"{setting_name(results['settings'])}:")
        print(format_table(results))
    print(f"report: {Path(out_dir) / 'report.md'}")
