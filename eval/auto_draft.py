"""`eval --num-draft auto`: each drafter's D chosen from what it buys on this device.

For every drafter, before it decodes the evaluation prompts:

1. it decodes a calibration split (never the evaluated prompts: the embedded corpus's
   validation split, whose test split eval scores; of a conversation dataset, the
   conversations after the evaluated ones, first user turn each) twice: at a generous D
   (`cap`, the largest d the choice may return), which gives its per-position acceptance
   a_k = P(first k drafts accepted), and at D = 1; the decoder's per-step statistics time
   the drafter (propose + commit) and the host work of a pass at both, and between and
   beyond them the cost is taken as linear in d (one drafter pass per chained draft, one
   head row per parallel one);
2. the verify pass at each d comes from the latency table (`--latency-table`, written by
   `draftsmith plan TARGET --measure` on this device; without one, eval measures one at the
   calibration's context length first), interpolated at the calibration's mean context;
3. D = argmax over d in 0 .. cap of E(d) / T(d), with E(d) = 1 + sum_{k<=d} a_k and
   T(d) = T_verify(d) + T_draft(d) + host(d) (models/latency.py: best_draft). On a GPU the
   cap is the tile rule's D (past it a verify pays a second tile); on a CPU, which has no
   tile, it is the table's largest d. d = 0 (no drafts) wins where no length pays.
   A drafter with a tuning face (`Proposer.tuning`, eval/proposers/base.py) gets D and its
   per-run options chosen together by it instead, from the passes it recorded (DSpark's
   confidence threshold; the EAGLE-2 tree's width and depth, eval/proposers/eagle3_tree_tuning.py).

The report keeps, per drafter, the chosen D, the tile rule's D and the whole curve.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.eval.decoding import Conversations, decode_conversations, decode_prompts, merge_stats, prompt_ids
from draftsmith.models.latency import (
    PAST_TILE,
    LatencyTable,
    best_draft,
    linear_cost,
    measure_latency,
)


@dataclass
class AutoPlan:
    table: LatencyTable
    cap: int  # the largest D the choice may return; calibration drafts this many
    tile_D: int
    prompts: list[torch.Tensor]
    split: str  # which prompts calibrate, in words
    context: float  # mean KV length of a calibration pass: where the table is read

    def describe(self) -> dict:
        data = self.table.data
        return {"calibration": self.split, "calibration_prompts": len(self.prompts), "cap": self.cap,
                "tile_rule_D": self.tile_D, "context": self.context,
                "latency_table": {"source": self.table.source, "device": data["device"], "dtype": data["dtype"],
                                  "attention": data["attention"], "contexts": data["contexts"],
                                  "max_draft": self.table.max_draft}}


def plan_auto(target, plan, prompts: list[torch.Tensor], split: str, max_new_tokens: int,
              table_path: str = "", progress=None) -> AutoPlan:
    """The latency table (read, or measured here at the calibration's context) and the cap."""
    if not prompts:
        raise DraftsmithError("eval --num-draft auto: no calibration prompts")
    device = next(target.parameters()).device
    context = sum(len(p) + max_new_tokens / 2 for p in prompts) / len(prompts)
    if table_path:
        table = LatencyTable.read(table_path).check_fits(target.config, device.type)  # export's check too
    else:
        top = plan.D if device.type == "cuda" else plan.D + PAST_TILE
        limit = getattr(target.config, "max_position_embeddings", None)
        measured_at = max(1, round(context))
        if limit is not None:
            top = max(0, min(top, limit - measured_at - 1))
        table = LatencyTable.check(measure_latency(target, [measured_at], top, reps=3, plan=plan,
                                                   target_name="the eval target", progress=progress),
                                   "latency table measured by eval")
        table.source = "measured by this eval"
    cap = min(table.max_draft, plan.D) if device.type == "cuda" else table.max_draft
    return AutoPlan(table, cap, plan.D, prompts, split, context)


def _per_pass(stats) -> tuple[list[float], float, float]:
    """(acceptance per position, drafter + host ms, host ms per pass) of merged stats."""
    passes = max(1, stats.verify_passes)
    return (stats.per_position_acceptance, 1000.0 * (stats.draft_s + stats.other_s) / passes,
            1000.0 * stats.other_s / passes)


def choose(proposer, make_decoder, auto: AutoPlan, sampling, settings, plain_host_ms: float) -> tuple[int, dict]:
    """(D, what the report keeps) for one drafter, calibrated on `proposer`, one of its own (so
    the evaluated one's counters start at zero); `make_decoder(proposer, num_draft)` builds its
    decoder. The calibration prompts are decoded as eval decodes its own (`decode_prompts`,
    seeded per prompt). The row's `options` (its tuning's) are for the evaluated drafter."""

    if auto.cap < 1:
        return 0, {"chosen": 0, "tile_rule_D": auto.tile_D, "cap": auto.cap, "curve": []}
    runs, tuning = {}, proposer.tuning()
    for d in sorted({auto.cap, 1}, reverse=True):
        decoder = make_decoder(proposer, d)
        if tuning is not None:
            tuning.record(d)
        decoder.generate(auto.prompts[0][:8], 4, sampling)  # warm-up
        stats, _ = decode_prompts(decoder, auto.prompts, settings, sampling, f"calibrate {proposer.name} D={d}")
        runs[d] = _per_pass(merge_stats(stats))
    acceptance, high, host_ms = runs[auto.cap]
    low = runs[1][1]
    drafting = linear_cost((1, low), (auto.cap, high))

    def pass_ms(d: int, drafting=drafting) -> float:
        return auto.table.verify_ms(d, auto.context) + (drafting(d) if d else plain_host_ms)

    choice = best_draft(acceptance, pass_ms, auto.cap)
    row = {"chosen": choice.num_draft, "tile_rule_D": auto.tile_D, "cap": auto.cap,
           "acceptance": acceptance, "draft_and_host_ms": {"1": low, str(auto.cap): high},
           "plain_host_ms": plain_host_ms, "curve": choice.curve,
           "predicted_tokens_per_s": choice.at(choice.num_draft)["tokens_per_s"]}
    if tuning is None:
        return choice.num_draft, row
    if tuning.prices_own_drafting:  # the host work alone: the tuning adds the drafting it timed
        tuned = tuning.choose(lambda d: pass_ms(d, lambda _d: host_ms), auto.cap)
    else:
        tuned = tuning.choose(pass_ms, auto.cap)
    row.update(tuned.record, chosen=tuned.num_draft, predicted_tokens_per_s=tuned.tokens_per_s,
               options=tuned.options, columns=tuned.columns, note=tuned.note)
    return tuned.num_draft, row


def calibration_prompts(settings, source, tokenizer, context: int, target=None, eos=None) -> tuple[list[torch.Tensor], str]:
    """Prompts disjoint from the evaluated ones, and which they are in words. Of a conversation
    dataset, every turn of the calibration conversations, each after the target's own greedy
    answers to the turns before it, as eval decodes the evaluated ones (a later turn often asks
    to rework an answer, which is where copying drafters earn their keep: first turns alone
    would calibrate them low)."""
    import dataclasses


    count = settings.calibration_prompts
    if not isinstance(source, Conversations):
        return (prompt_ids(tokenizer, settings, context, count, split="validation", which="calibration prompt"),
                f"{count} prompts of the embedded corpus's validation split (the evaluated ones are from its "
                "test split)")
    from draftsmith.eval.prompts import eval_conversations

    first = len(source.turns)
    rows = eval_conversations(settings.dataset, first + count)[first:]
    if len(rows) < count:
        raise DraftsmithError(f"eval --num-draft auto: dataset {settings.dataset} has {first + len(rows)} "
                              f"conversations; after the {first} evaluated, {len(rows)} are left for the "
                              f"{count} calibration prompts (lower --num-prompts)")
    from draftsmith.eval.decoder import SpeculativeDecoder
    from draftsmith.eval.proposers.base import GREEDY, NoProposer

    plain = SpeculativeDecoder(target, NoProposer(), num_draft=0, eos_token_id=eos)
    prompts, _, _ = decode_conversations(plain, dataclasses.replace(source, turns=rows), settings, GREEDY,
                                         "calibration turns")
    return prompts, (f"every turn of conversations {first + 1}..{first + count} of {settings.dataset}, after the "
                     f"target's greedy answers (the evaluated ones are 1..{first})")
