"""The serving engine's columns and section in a report (eval/engine.py writes the records):
report.md and `draftsmith report` show them beside our own figures for the same drafter,
prompts and D.

A record (`plain.engine`, a drafter's `engine` and `engine_<layout>`): engine, layout,
speculative_config, and either `refused` (one line: why it did not serve) or tau,
mean_acceptance_length, per_position_acceptance, tokens_per_s, speedup (over the engine's own
plain decoding), greedy_equal (None when sampling), prompts_equal ("equal/all"), start_s, and,
greedy where the engine gives each request's steps, step_check {passes_compared, passes_differing,
passes_out_of_step, first_difference} (eval/engine.py's step_differences).
"""

from __future__ import annotations

import json

HEADER = ["vLLM tau", "vLLM tokens/s", "vLLM speedup", "vLLM = ours"]


def records(row: dict) -> list[dict]:
    """A row's engine records: its first layout's (`engine`), then the others'."""
    return [value for key, value in row.items() if (key == "engine" or key.startswith("engine_"))
            and isinstance(value, dict)]


def has_engine(results: dict) -> bool:
    """Whether a report (or `draftsmith report`'s other targets' plain rows: no drafters) has engine figures."""
    return "engine" in results["plain"] or any(records(d) for d in results.get("drafters", ()))


def _equal(record: dict) -> str:
    if record.get("greedy_equal") is None:
        return f"sampled ({record.get('prompts_equal', '-')} equal)" if "prompts_equal" in record else "-"
    return ("yes" if record["greedy_equal"] else "NO") + f" ({record['prompts_equal']})"


def _steps(record: dict) -> str:
    check = record.get("step_check")
    if not check:
        return "-"
    first = check["first_difference"]
    where = f", first: prompt {first['prompt']}, token {first['position']}" if first else ""
    return f"{check['passes_differing']}/{check['passes_compared']}{where}"


def cells(record: dict | None, plain: bool = False) -> list[str]:
    """The four engine cells of a row: '-' without a record, 'refused' where it did not serve."""
    if not record:
        return ["-"] * len(HEADER)
    if "refused" in record:
        return ["refused", "-", "-", "-"]
    tau = "1.00" if plain else f"{record['tau']:.2f}"
    speedup = "1.00x" if plain else (f"{record['speedup']:.2f}x" if record.get("speedup") else "-")
    return [tau, f"{record['tokens_per_s']:.1f}", speedup, _equal(record)]


def section(results: dict) -> list[str]:
    """What the engine was given and what it said, every layout, refusals in its own words."""
    if not has_engine(results):
        return []
    plain = results["plain"].get("engine") or {}
    lines = ["## The serving engine", "",
             f"{plain.get('engine', 'vLLM')} decoded the same prompt ids one request at a time, each drafter "
             "served by the line `draftsmith export` prints for it with D set to the row's. Its tau is committed "
             "tokens over target passes from its counters (`/metrics`, `vllm:spec_decode_*`), as ours; "
             "vLLM's own mean acceptance length (1 + accepted / drafts) counts only the passes that drafted. "
             "Speedup is over the engine's own plain decoding "
             f"({plain['tokens_per_s']:.1f} tokens/s)." if "tokens_per_s" in plain else
             f"Plain decoding in the engine: {plain.get('refused', 'not run')}.", "",
             "| drafter | layout | D | tau, ours | tau, vLLM | vLLM mean acceptance length | tokens/s | speedup | "
             "greedy = ours | passes accepted otherwise | started in |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |"]
    notes = []
    for d in results["drafters"]:
        for record in records(d):
            if "refused" in record:
                lines.append(f"| {d['name']} | {record['layout']} | {d['num_draft']} | {d['tau']:.2f} | refused | "
                             "- | - | - | - | - | - |")
                notes.append(f"- {d['name']} ({record['layout']}): {record['refused']}")
                continue
            mal = record.get("mean_acceptance_length")
            lines.append(f"| {d['name']} | {record['layout']} | {d['num_draft']} | {d['tau']:.2f} | "
                         f"{record['tau']:.2f} | {f'{mal:.2f}' if mal else '-'} | {record['tokens_per_s']:.1f} | "
                         f"{record['speedup']:.2f}x | {_equal(record)} | {_steps(record)} | {record.get('start_s', '-')} s |")
            if record.get("note"):
                notes.append(f"- {d['name']} ({record['layout']}): {record['note']}")
            notes.append(f"- {d['name']} ({record['layout']}) speculative config: "
                         f"`{json.dumps(record.get('speculative_config'))}`")
    return lines + ["", *notes, ""]
