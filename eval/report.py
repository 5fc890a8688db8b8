"""Evaluation reports: report.json for machines, report.md and PNG plots for people.

The results a benchmark hands to `write_report` (report.json is this dict as given):

    target:   {path, H, KV, G, tile, D}          the target's tile plan (eval/tile.py)
    settings: {dataset, num_prompts, max_new_tokens, temperature, top_k, top_p, seed}
    plain:    {tokens_per_s, T_target_ms}        plain decoding: same target, prompts, settings, run;
              optional distinct_4gram, looping_prompts (how many of its texts loop)
    drafters: [{
        name, drafter,                           display name; the --drafter argument (NAME[:PATH])
        num_draft,                               D, the drafts proposed per verify pass
        tau,                                     committed tokens / verify passes, bonus included
        tau_no_loop,                             optional: tau over the prompts whose plain text
                                                 does not loop (None when every one does)
        verify_passes, committed_tokens,
        per_position_acceptance: [D floats],     k = 1..D: fraction of passes accepting draft k
        accepted_length_hist: [D + 1 ints],      [i]: passes that accepted exactly i drafts
        tokens_per_s, speedup,                   measured; speedup = tokens_per_s / plain's
        bound,                                   optional; if given, must equal speedup_bound(...)
        T_draft_ms, T_verify_ms,                 mean time per verify pass to draft and to verify
        extra: {name: value},                    optional, method-specific (e.g. early_stop_rate)
        engine, engine_<layout>: {...}           optional, the serving engine's figures for this
                                                 drafter (eval/engine_report.py; plain.engine too)
    }]
    prompts:  [{prompt_ids: [...], outputs: {drafter name or "plain": [ids]},
                loops: bool, steps: {drafter name: [committed, verify passes]},
                accepted: {drafter name: [drafts kept per verify pass]}}]   optional

Times are milliseconds. tau follows EAGLE, SGLang, SpecForge, DFlash and Spec-Bench: the
bonus (or resampled) token counts, so plain decoding scores 1 (docs/design.md section 4).
Reports written before plain decoding was named "plain" hold it under "baseline"; their
readers take them through `plain_named`.
"""

from __future__ import annotations

import math
from pathlib import Path

from draftsmith.errors import DraftsmithError
from draftsmith.eval import engine_report
from draftsmith.fsutil import atomic_dir, check_replaceable, write_json

PLAIN = "plain"  # plain decoding's key: its figures (results[PLAIN]) and each prompt's outputs[PLAIN]
_OLD_PLAIN = "baseline"  # the same, in reports written before it was named "plain"
_REQUIRED = {
    "target": ("path", "H", "KV", "G", "tile", "D"),
    "settings": ("dataset", "num_prompts", "max_new_tokens", "temperature", "top_k", "top_p", "seed"),
    PLAIN: ("tokens_per_s", "T_target_ms"),
}
_DRAFTER_REQUIRED = (
    "name", "drafter", "num_draft", "tau", "verify_passes", "committed_tokens",
    "per_position_acceptance", "accepted_length_hist", "tokens_per_s", "speedup",
    "T_draft_ms", "T_verify_ms",
)
PLOTS = {
    "acceptance.png": "acceptance per draft position",
    "tau.png": "tau per drafter",
    "speedup.png": "measured speedup beside its bound",
    "accepted_lengths.png": "accepted drafts per verify pass",
}
AUTO_PLOT = "num_draft.png"  # with --num-draft auto: expected tokens/s against d, per drafter
TAU_NOTE = (
    "tau counts the bonus token: it is committed tokens per target verify pass, so plain "
    "decoding scores 1.00 (the EAGLE, SGLang, SpecForge and Spec-Bench convention); "
    "transformers and gpt-fast print tau - 1."
)


# A prompt whose plain continuation has fewer distinct 4-grams per 4-gram than this loops:
# half its text repeats what came before (a token repeated or a short cycle scores < 0.1).
LOOP_RATIO = 0.5


def loops(ids: list[int]) -> bool:
    """Whether a continuation is a loop (`LOOP_RATIO`)."""
    return distinct_4gram_ratio([ids]) < LOOP_RATIO


def distinct_4gram_ratio(outputs: list[list[int]]) -> float:
    """Mean over outputs of distinct 4-grams / 4-grams: near 0 for text that loops, 1 for
    text without a repeated 4-gram. A drafter's tau on a loop measures the loop, not skill."""
    ratios = []
    for ids in outputs:
        grams = [tuple(ids[i:i + 4]) for i in range(len(ids) - 3)]
        if grams:
            ratios.append(len(set(grams)) / len(grams))
    return sum(ratios) / len(ratios) if ratios else float("nan")


def temperature_label(temperature: float) -> str:
    """The folder name of one temperature's report: t0, t0.7, ... in the exact value, so two
    settings never share a folder (`:g` printed 1e-7 and 1.0000001e-7 both as t1e-07)."""
    value = float(temperature) + 0.0  # -0.0 is 0.0
    short = f"{value:g}"
    return f"t{short if float(short) == value else repr(value)}"


def setting_label(results: dict) -> str:
    """The folder name of one setting's report (`temperature_label`)."""
    return temperature_label(results["settings"]["temperature"])


def setting_name(settings: dict) -> str:
    """"greedy", or the sampling settings that are in effect."""
    if settings["temperature"] == 0:
        return "greedy"
    parts = [f"temperature {settings['temperature']:g}"]
    if settings.get("top_p", 1.0) < 1.0:
        parts.append(f"top-p {settings['top_p']:g}")
    if settings.get("top_k", 0):
        parts.append(f"top-k {settings['top_k']}")
    return ", ".join(parts)


def text_line(results: dict) -> str:
    s, d4 = results["settings"], results[PLAIN].get("distinct_4gram")
    line = f"{s['num_prompts']} prompts from `{s['dataset']}`, {s['max_new_tokens']} new tokens each."
    if d4 is not None:
        line += (f" Plain decoding's text has {d4:.2f} distinct 4-grams per 4-gram (1: no repeats; "
                 "near 0: a loop, which n-gram lookup copies and no drafter needs to learn).")
    looping = results[PLAIN].get("looping_prompts")
    if looping is not None:
        line += (f" On {looping} of the {s['num_prompts']} prompts it loops (under {LOOP_RATIO} distinct "
                 "4-grams); \"tau, no loop\" counts the other prompts only.")
    return line


def target_name(target: dict) -> str:
    """The target as the user named it (a folder, a hub or embedded name, a GGUF file)."""
    return target.get("name") or target["path"]


def target_label(target: dict) -> str:
    """The target's name, and the folder that name resolved to where it differs."""
    name = target_name(target)
    return f"`{name}`" + (f" (`{target['path']}`)" if name != target["path"] else "")


def speedup_bound(tau: float, t_target: float, t_draft: float, t_verify: float) -> float:
    """Speedup if nothing but drafting and verifying took time: tau * T_target / (T_draft + T_verify)."""
    if t_draft + t_verify <= 0:
        raise DraftsmithError(f"T_draft + T_verify must be positive, got {t_draft} + {t_verify}")
    return tau * t_target / (t_draft + t_verify)


def check_report_dest(out_dir: str | Path) -> None:
    """Refuse an --out that a report would destroy (see fsutil.check_replaceable)."""
    check_replaceable(out_dir, "report.json", "report")


def plot_setting(drafters: list[dict], bounds: list[float], folder: Path) -> None:
    """One setting's acceptance, tau and speedup (beside its bound) plots into `folder`."""
    _plot_acceptance(drafters, folder / "acceptance.png")
    _plot_tau(drafters, folder / "tau.png")
    _plot_speedup(drafters, bounds, folder / "speedup.png")


def write_report(results: dict, out_dir: str | Path) -> Path:
    """Write report.json, report.md and the plots into `out_dir`, all or nothing."""
    _check(results)
    out_dir = Path(out_dir)
    with atomic_dir(out_dir) as tmp:
        write_json(tmp / "report.json", results)
        (tmp / "report.md").write_text(_markdown(results), encoding="utf-8")
        plot_setting(results["drafters"], [bound(d, results[PLAIN]) for d in results["drafters"]], tmp)
        _plot_accepted_lengths(results["drafters"], tmp / "accepted_lengths.png")
        if any("num_draft_auto" in d for d in results["drafters"]):
            _plot_num_draft(results["drafters"], tmp / AUTO_PLOT)
    return out_dir


def write_index(runs: list[tuple[str, dict]], out_dir: str | Path) -> None:
    """The front page of several reports (one per temperature): their drafter tables side
    by side, each linking to its full report. `out_dir` exists; the caller owns atomicity."""
    out_dir = Path(out_dir)
    target = runs[0][1]["target"]
    lines = ["# Speculative decoding report", "",
             f"Target {target_label(target)}: G = {target['G']} query heads per KV head, tile {target['tile']} rows, "
             f"D = {target['D']} drafts per verify.", "", TAU_NOTE, ""]
    for label, results in runs:
        s = results["settings"]
        lines += [f"## {setting_name(s).capitalize()} ([full report]({label}/report.md))", "",
                  text_line(results), "",
                  format_table(results), "", f"![tau]({label}/tau.png) ![acceptance]({label}/acceptance.png)", ""]
    (out_dir / "report.md").write_text("\n".join(lines))
    write_json(out_dir / "report.json", {"runs": {label: f"{label}/report.json" for label, _ in runs}})


def format_table(results: dict) -> str:
    """The drafters side by side, plain decoding first, as a Markdown table."""
    _check(results)
    return _drafter_table(results)


def _drafter_table(results: dict) -> str:
    drafters = results["drafters"]
    extras = list(dict.fromkeys(key for d in drafters for key in d.get("extra") or {}))
    split = any("tau_no_loop" in d for d in drafters)
    weights = any(d.get("weights") for d in drafters)  # which of a run's weights: best, a checkpoint, last
    header = ["drafter", *(["weights"] if weights else []), "D", "tau", *(["tau, no loop"] if split else []),
              "tokens/s", "speedup", "bound", "T_draft ms", "T_verify ms"]
    header += [key.replace("_", " ") for key in extras]
    engine = engine_report.has_engine(results)
    header += engine_report.HEADER if engine else []
    plain = results[PLAIN]
    rows = [["plain decoding", *(["-"] if weights else []), "0", "1.00", *(["1.00"] if split else []),
             f"{plain['tokens_per_s']:.1f}", "1.00x", "-", "-", "-"] + ["-"] * len(extras)
            + (engine_report.cells(plain.get("engine"), plain=True) if engine else [])]
    for d in drafters:
        no_loop = d.get("tau_no_loop")
        row = [
            d["name"], *([d.get("weights") or "-"] if weights else []), str(d["num_draft"]), f"{d['tau']:.2f}",
            *([f"{no_loop:.2f}" if no_loop is not None else "-"] if split else []), f"{d['tokens_per_s']:.1f}",
            f"{d['speedup']:.2f}x", f"{bound(d, plain):.2f}x",
            f"{d['T_draft_ms']:.2f}", f"{d['T_verify_ms']:.2f}",
        ]
        row += [_cell((d.get("extra") or {}).get(key)) for key in extras]
        rows.append(row + (engine_report.cells(d.get("engine")) if engine else []))
    align = ["---"] + ["---:"] * (len(header) - 1)
    return "\n".join("| " + " | ".join(cells) + " |" for cells in [header, align, *rows])


def bound(drafter: dict, plain: dict) -> float:
    """tau * T_target / (T_draft + T_verify): the speedup the measured times allow (`plain`:
    plain decoding's figures, T_target among them)."""
    return speedup_bound(
        drafter["tau"], plain["T_target_ms"], drafter["T_draft_ms"], drafter["T_verify_ms"]
    )


def plain_named(results):
    """A report.json's results as this version names them: one written before plain decoding
    was named "plain" (its figures, each prompt's outputs and a combined report's `others`
    under "baseline") renamed; any other value as it is (its reader's check judges it)."""
    if not isinstance(results, dict) or _OLD_PLAIN not in results or PLAIN in results:
        return results
    renamed = {PLAIN if key == _OLD_PLAIN else key: value for key, value in results.items()}
    if isinstance(renamed.get("prompts"), list):
        renamed["prompts"] = [_outputs_renamed(p) for p in renamed["prompts"]]
    if isinstance(renamed.get("others"), list):
        renamed["others"] = [plain_named(other) for other in renamed["others"]]
    return renamed


def _outputs_renamed(prompt):
    outputs = prompt.get("outputs") if isinstance(prompt, dict) else None
    if not isinstance(outputs, dict):
        return prompt
    return {**prompt, "outputs": {PLAIN if name == _OLD_PLAIN else name: ids for name, ids in outputs.items()}}


def _cell(value) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def _check(results: dict) -> None:
    """Fail on the first missing key, by its path, before anything is written."""
    for section, keys in _REQUIRED.items():
        _require(results, section, "")
        for key in keys:
            _require(results[section], key, section)
    _require(results, "drafters", "")
    if not results["drafters"]:
        raise DraftsmithError("results have no drafters to compare")
    for i, d in enumerate(results["drafters"]):
        where = f"drafters[{i}]"
        for key in _DRAFTER_REQUIRED:
            _require(d, key, where)
        num_draft = d["num_draft"]
        if len(d["per_position_acceptance"]) != num_draft or len(d["accepted_length_hist"]) != num_draft + 1:
            raise DraftsmithError(
                f"{where} ({d['name']}): per_position_acceptance needs {num_draft} values and "
                f"accepted_length_hist {num_draft + 1} for num_draft {num_draft}"
            )
        # A bound computed elsewhere with another tau convention would silently mislead.
        expected = bound(d, results[PLAIN])
        if "bound" in d and not math.isclose(d["bound"], expected, rel_tol=0.01):
            raise DraftsmithError(
                f"{where}.bound is {d['bound']}, but tau * T_target / (T_draft + T_verify) = {expected:.4g}"
            )
    names = [d["name"] for d in results["drafters"]]
    if len(set(names)) != len(names):
        raise DraftsmithError(f"drafter names must be unique, got {', '.join(names)}")


def _require(obj: dict, key: str, where: str) -> None:
    if not isinstance(obj, dict) or key not in obj:
        raise DraftsmithError(f"results have no {where + '.' if where else ''}{key}")


def _markdown(results: dict) -> str:
    target, settings, plain = results["target"], results["settings"], results[PLAIN]
    drafters = results["drafters"]
    # How a conversation dataset's prompts were rendered, where eval recorded it (eval/prompts.py).
    setting_keys = (*_REQUIRED["settings"], *(k for k in ("conversations", "enable_thinking") if k in settings))
    lines = [
        "# Speculative decoding report",
        "",
        f"Target {target_label(target)}: H = {target['H']} query heads, KV = {target['KV']} KV heads, "
        f"G = {target['G']} (the group size, query heads per KV head, that the verify kernel packs), "
        f"tile {target['tile']} rows, so D = {target['D']} drafts fit one tile.",
        "",
        "## Settings",
        "",
        "| " + " | ".join(k.replace("_", " ") for k in setting_keys) + " |",
        "|" + "---|" * len(setting_keys),
        "| " + " | ".join(str(settings[k]) for k in setting_keys) + " |",
        "",
        text_line(results),
        "",
        "## Drafters",
        "",
        _drafter_table(results),
        "",
        TAU_NOTE,
        f"Speedup is measured tokens/s over plain decoding ({plain['tokens_per_s']:.1f} tokens/s, "
        f"T_target = {plain['T_target_ms']:.2f} ms per step) in the same run; bound = "
        "tau * T_target / (T_draft + T_verify) from the measured times.",
        "",
        "![tau per drafter](tau.png)",
        "![measured speedup beside its bound](speedup.png)",
        "",
        "## Acceptance per draft position",
        "",
        "Fraction of verify passes in which draft position k was accepted.",
        "",
        "| k | " + " | ".join(d["name"] for d in drafters) + " |",
        "|---:|" + "---:|" * len(drafters),
    ]
    for k in range(1, max((d["num_draft"] for d in drafters), default=0) + 1):
        cells = [
            f"{d['per_position_acceptance'][k - 1]:.3f}" if k <= d["num_draft"] else "-" for d in drafters
        ]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "![per-position acceptance](acceptance.png)",
        "",
        "## Accepted drafts per verify pass",
        "",
        "![histogram of accepted drafts](accepted_lengths.png)",
        "",
    ]
    return "\n".join(lines + engine_report.section(results) + _auto_section(results))


# Plots draw on a bare Figure: it renders with Agg and touches no pyplot global state,
# so reports can be written from threads and headless machines alike.
def _figure(integer_x: bool = False):
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(6.4, 4.0), layout="constrained")
    ax = fig.add_subplot()
    if integer_x:  # draft positions and counts: no ticks at 1.5
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return fig, ax


def _save(fig, path: Path, title: str) -> None:
    fig.axes[0].set_title(title)
    fig.savefig(path, dpi=120)


def _name_ticks(ax, drafters: list[dict]) -> None:
    ax.set_xticks(range(len(drafters)), [d["name"] for d in drafters], rotation=20, ha="right")


def _plot_acceptance(drafters: list[dict], path: Path) -> None:
    fig, ax = _figure(integer_x=True)
    for d in drafters:
        ax.plot(range(1, d["num_draft"] + 1), d["per_position_acceptance"], marker="o", label=d["name"])
    ax.set(xlabel="draft position k", ylabel="fraction of verify passes accepted", ylim=(0, 1.02))
    ax.legend()
    _save(fig, path, PLOTS[path.name])


def _plot_tau(drafters: list[dict], path: Path) -> None:
    fig, ax = _figure()
    bars = ax.bar(range(len(drafters)), [d["tau"] for d in drafters])
    ax.bar_label(bars, fmt="%.2f")
    ax.axhline(1.0, color="grey", linestyle="--", label="plain decoding")
    _name_ticks(ax, drafters)
    ax.set(ylabel="tau (tokens per verify pass, bonus included)")
    ax.legend()
    _save(fig, path, PLOTS[path.name])


def _plot_speedup(drafters: list[dict], bounds: list[float], path: Path, width: float = 0.4) -> None:
    fig, ax = _figure()
    x = range(len(drafters))
    measured = ax.bar([i - width / 2 for i in x], [d["speedup"] for d in drafters], width, label="measured")
    bound = ax.bar([i + width / 2 for i in x], bounds, width, label="bound")
    for bars in (measured, bound):
        ax.bar_label(bars, fmt="%.2f")
    ax.axhline(1.0, color="grey", linestyle="--")
    _name_ticks(ax, drafters)
    ax.set(ylabel="speedup over plain decoding")
    ax.legend()
    _save(fig, path, PLOTS[path.name])


def _plot_accepted_lengths(drafters: list[dict], path: Path) -> None:
    fig, ax = _figure(integer_x=True)
    for d in drafters:
        counts = d["accepted_length_hist"]
        total = sum(counts) or 1
        edges = [i - 0.5 for i in range(len(counts) + 1)]
        ax.stairs([c / total for c in counts], edges, label=d["name"])
    ax.set(xlabel="drafts accepted in one verify pass", ylabel="fraction of verify passes")
    ax.legend()
    _save(fig, path, PLOTS[path.name])


# ---- --num-draft auto (eval/auto_draft.py): why each drafter got its D ------------------

def _auto_section(results: dict) -> list[str]:
    rows = [d for d in results["drafters"] if "num_draft_auto" in d]
    if not rows:
        return []
    how = results.get("num_draft_auto") or {}
    table = how.get("latency_table") or {}
    lines = ["## Draft length per drafter (--num-draft auto)", "",
             f"Calibrated on {how.get('calibration', 'a calibration split')}: acceptance measured there at D = "
             f"{how.get('cap')} (the most the choice may give; tile rule D = {how.get('tile_rule_D')}), drafter and "
             f"host time at D = 1 and D = {how.get('cap')}, the verify pass from the latency table "
             f"({table.get('source', '?')}: {table.get('device', '?')}, {table.get('dtype', '?')}, "
             f"{table.get('attention', '?')}) at context {how.get('context', 0):.0f}. D maximises expected tokens/s "
             "= E(d) / T(d), E(d) = 1 + sum_{k<=d} a_k, T(d) = T_verify(d) + T_draft(d) + host.", ""]
    # A drafter with a tuning face (eval/proposers/base.py: Tuning) chose options with D: its
    # note says how, its columns what.
    notes = dict.fromkeys(d["num_draft_auto"]["note"] for d in rows if d["num_draft_auto"].get("note"))
    columns = list(dict.fromkeys(key for d in rows for key in d["num_draft_auto"].get("columns") or {}))
    lines += [line for note in notes for line in (note, "")]
    lines += ["| drafter | chosen D | " + "".join(f"{key} | " for key in columns)
              + "predicted tokens/s | tile rule D | predicted tokens/s at it | measured tokens/s |",
              "|---|---:|" + "---:|" * (len(columns) + 4)]
    for d in rows:
        auto = d["num_draft_auto"]
        curve = {p["d"]: p for p in auto["curve"]}
        at = lambda k: f"{curve[k]['tokens_per_s']:.1f}" if k in curve else "-"  # noqa: E731
        tuned = [_cell((auto.get("columns") or {}).get(key)) for key in columns]
        predicted = auto.get("predicted_tokens_per_s")
        lines.append(f"| {d['name']} | {auto['chosen']} | " + "".join(f"{cell} | " for cell in tuned)
                     + f"{'-' if predicted is None else f'{predicted:.1f}'} | {auto['tile_rule_D']} | "
                     f"{at(auto['tile_rule_D'])} | {d['tokens_per_s']:.1f} |")
    return lines + ["", f"![expected tokens/s against drafts]({AUTO_PLOT})", ""]


def _plot_num_draft(drafters: list[dict], path: Path) -> None:
    fig, ax = _figure(integer_x=True)
    for d in drafters:
        auto = d.get("num_draft_auto")
        if not auto or not auto["curve"]:
            continue
        xs = [p["d"] for p in auto["curve"]]
        line, = ax.plot(xs, [p["tokens_per_s"] for p in auto["curve"]], label=d["name"])
        best = next(p for p in auto["curve"] if p["d"] == auto["chosen"])
        ax.plot([best["d"]], [best["tokens_per_s"]], marker="o", color=line.get_color())
    tile = next((d["num_draft_auto"]["tile_rule_D"] for d in drafters if d.get("num_draft_auto")), None)
    if tile is not None:
        ax.axvline(tile, color="grey", linestyle="--", label=f"tile rule D = {tile}")
    ax.set(xlabel="drafts per verify d", ylabel="expected tokens/s (calibration)", ylim=(0, None))
    ax.legend()
    _save(fig, path, "expected tokens/s against d (dot: the chosen D)")
