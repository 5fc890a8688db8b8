"""Several `draftsmith eval` reports on one page (`draftsmith report`), per decoding setting.

Drafters measured against different targets sit side by side: the demo's MTP heads are
measured on the tiny target they were pretrained with, every other drafter on the real one.
The first report is the primary one: its target, settings and plain decoding head each
setting. A row of another report is named `NAME (FOLDER)`, after its report's folder, and
keeps its own target's plain decoding as the reference of its speedup and bound; its tau
compares with the primary rows only as far as the two targets' texts do (the page says so).

The folder holds report.md and report.json (the settings' labels, each naming
LABEL/report.json: the primary report's results with every report's drafters, each row
carrying its `target_name` and `report` (its report's place in the list), and `others`, the
other reports' targets, settings and plain decoding), and per setting the tau, speedup and
acceptance plots.
"""

from __future__ import annotations

import os
from pathlib import Path

from draftsmith.errors import DraftsmithError
from draftsmith.eval import engine_report
from draftsmith.eval.report import (
    PLAIN,
    TAU_NOTE,
    bound,
    check_report_dest,
    plain_named,
    plot_setting,
    setting_label,
    setting_name,
    target_label,
    target_name,
    text_line,
)
from draftsmith.fsutil import atomic_dir, check_not_an_input, read_json, write_json
from draftsmith.schema import Count, NonNegativeFloat, PositiveInt, Schema, validated

SHOWN_POSITIONS = 4  # per-position acceptance columns in the table (the plots show every position)


class _Target(Schema):
    path: str
    name: str | None = None
    H: PositiveInt
    KV: PositiveInt
    G: PositiveInt
    tile: PositiveInt
    D: Count


class _Settings(Schema):
    dataset: str
    num_prompts: Count
    max_new_tokens: Count
    temperature: NonNegativeFloat
    top_k: Count
    top_p: NonNegativeFloat
    seed: Count


class _Plain(Schema):
    tokens_per_s: NonNegativeFloat
    T_target_ms: NonNegativeFloat
    distinct_4gram: NonNegativeFloat | None = None
    looping_prompts: Count | None = None


class _Drafter(Schema):
    name: str
    drafter: str
    num_draft: Count
    tau: NonNegativeFloat
    tau_no_loop: NonNegativeFloat | None = None
    verify_passes: Count
    committed_tokens: Count
    per_position_acceptance: list[NonNegativeFloat]
    accepted_length_hist: list[Count]
    tokens_per_s: NonNegativeFloat
    speedup: NonNegativeFloat
    T_draft_ms: NonNegativeFloat
    T_verify_ms: NonNegativeFloat


class SettingReport(Schema):
    """One setting's report.json as eval writes it (eval/report.py's _REQUIRED keys, typed):
    what `draftsmith report` and the bench scripts read of it."""

    target: _Target
    settings: _Settings
    plain: _Plain
    drafters: list[_Drafter]


class _Index(Schema):
    runs: dict[str, str]


def read_runs(report_dir: str | Path) -> dict[str, dict]:
    """Setting label (t0, t0.7, ...) -> that setting's results, from an eval output folder;
    each report.json checked (SettingReport) where it is read, the one reader of them (one
    written before plain decoding was named "plain" read too: report.py's plain_named)."""
    report_dir = Path(report_dir)
    if not (report_dir / "report.json").is_file():
        raise DraftsmithError(f"report {report_dir}: no report.json (an output folder of draftsmith eval)")
    index = read_json(report_dir / "report.json")
    if "runs" not in index:  # a single-setting report
        results = _setting(index, report_dir / "report.json")
        return {setting_label(results): results}
    runs = validated(_Index, index, str(report_dir / "report.json")).runs
    return {label: _setting(read_json(report_dir / rel), report_dir / rel) for label, rel in runs.items()}


def _setting(results: dict, path: Path) -> dict:
    results = plain_named(results)
    validated(SettingReport, results, str(path))
    return results


def _check_settings(reports: list[tuple[Path, dict]]) -> None:
    """Eval reports only (a combined one would lose its own rows' targets), each holding every
    setting of the first, decoded alike (temperature, top-p, top-k)."""
    first, runs0 = reports[0]
    for folder, runs in reports:
        if any("others" in results for results in runs.values()):
            raise DraftsmithError(f"report {folder} is a combined report: give the eval folders it was made from")
        for label, results in runs0.items():
            if label not in runs:
                raise DraftsmithError(f"report {folder} has no {label} setting (the first report, {first}, has "
                                      f"{', '.join(runs0)}): evaluate both at the same settings")
            mine, theirs = setting_name(runs[label]["settings"]), setting_name(results["settings"])
            if mine != theirs:
                raise DraftsmithError(f"report {folder} decoded {label} as {mine}, the first report ({first}) as "
                                      f"{theirs}: evaluate both at the same settings")


def _suffixes(folders: list[Path]) -> list[str]:
    """"" for the primary report, else its folder's name, with as many parent names as make
    it unique among the reports (`x/eval`, `y/eval` -> `x/eval`, `y/eval`)."""
    parts = [folder.resolve().parts for folder in folders]
    for depth in range(1, max(len(p) for p in parts) + 1):
        names = ["/".join(p[-depth:]) for p in parts]
        if len(set(names[1:])) == len(names[1:]) and names[0] not in names[1:]:
            return ["", *names[1:]]
    return ["", *(str(folder.resolve()) for folder in folders[1:])]


def _rows(results: dict, suffix: str, report: int) -> list[dict]:
    """The drafters of report number `report`, each naming its target and priced against its
    own report's plain decoding."""
    plain, target = results[PLAIN], results["target"]
    return [{**d, "name": f"{d['name']} ({suffix})" if suffix else d["name"], "target_name": target_name(target),
             "report": report, "bound": bound(d, plain)} for d in results["drafters"]]


def combine_reports(report_dirs: list[str | Path], out_dir: str | Path) -> Path:
    """One page of every report's drafters per setting; each report must hold every setting
    of the first. Written whole or not at all."""
    if not report_dirs:
        raise DraftsmithError("report: give at least one eval report folder")
    check_report_dest(out_dir)
    check_not_an_input(out_dir, {f"report {d}": d for d in report_dirs}, folder=True)
    inside = [d for d in report_dirs if Path(out_dir).resolve() in Path(d).resolve().parents]
    if inside:
        raise DraftsmithError(f"--out {out_dir} holds the report {inside[0]}; writing it would replace it: "
                              "give another path")
    folders = [Path(d).resolve() for d in report_dirs]
    twice = [d for d, folder in zip(report_dirs, folders) if folders.count(folder) > 1]
    if twice:
        raise DraftsmithError(f"report: {twice[0]} given twice")
    reports = [(Path(d), read_runs(d)) for d in report_dirs]
    _check_settings(reports)
    suffixes = _suffixes([folder for folder, _ in reports])
    labels = list(reports[0][1])
    merged = {}
    for label in labels:
        primary = reports[0][1][label]
        rows = [r for i, ((_, runs), suffix) in enumerate(zip(reports, suffixes))
                for r in _rows(runs[label], suffix, i)]
        names = [r["name"] for r in rows]
        if len(set(names)) != len(names):
            raise DraftsmithError(f"report: two drafters named alike in setting {label} ({', '.join(names)})")
        merged[label] = {**primary, "drafters": rows,
                         "others": [{"report": str(folder), "suffix": suffix, "target": runs[label]["target"],
                                     PLAIN: runs[label][PLAIN], "settings": runs[label]["settings"]}
                                    for (folder, runs), suffix in zip(reports[1:], suffixes[1:])]}
    out_dir = Path(out_dir)
    with atomic_dir(out_dir) as tmp:
        for label, results in merged.items():
            (tmp / label).mkdir()
            write_json(tmp / label / "report.json", results)
            plot_setting(results["drafters"], [r["bound"] for r in results["drafters"]], tmp / label)
        write_json(tmp / "report.json", {"runs": {label: f"{label}/report.json" for label in merged},
                                         "reports": [str(folder) for folder, _ in reports]})
        (tmp / "report.md").write_text(_markdown(merged, [folder for folder, _ in reports], out_dir), encoding="utf-8")
    return out_dir


def _table(results: dict) -> list[str]:
    positions = min(SHOWN_POSITIONS, max(r["num_draft"] for r in results["drafters"]))
    no_loop = any(r.get("tau_no_loop") is not None for r in results["drafters"])
    engine = engine_report.has_engine(results) or any(engine_report.has_engine(o) for o in results["others"])
    header = ["drafter", "target", "D", "tau", *(["tau, no loop"] if no_loop else []), "tokens/s", "speedup",
              "bound", *(f"accepted {k}" for k in range(1, positions + 1)), *(engine_report.HEADER if engine else [])]
    lines = ["| " + " | ".join(header) + " |", "| --- | --- |" + " ---: |" * (len(header) - 2)]
    plain = [("plain decoding", results["target"], results[PLAIN]),
             *((f"plain decoding ({o['suffix']})", o["target"], o[PLAIN]) for o in results["others"])]
    for i, (name, target, figures) in enumerate(plain):
        lines.append("| " + " | ".join([name, f"`{target_name(target)}`", "0", "1.00", *(["1.00"] if no_loop else []),
                                        f"{figures['tokens_per_s']:.1f}", "1.00x", "-", *["-"] * positions,
                                        *(engine_report.cells(figures.get("engine"), plain=True) if engine else [])]) + " |")
        lines += [_row(r, positions, no_loop, engine) for r in results["drafters"] if r["report"] == i]
    return lines


def _row(r: dict, positions: int, no_loop: bool, engine: bool) -> str:
    """One drafter's row."""
    split = r.get("tau_no_loop")
    accepted = [f"{r['per_position_acceptance'][k]:.2f}" if k < r["num_draft"] else "-" for k in range(positions)]
    cells = [r["name"], f"`{r['target_name']}`", str(r["num_draft"]), f"{r['tau']:.2f}",
             *([f"{split:.2f}" if split is not None else "-"] if no_loop else []), f"{r['tokens_per_s']:.1f}",
             f"{r['speedup']:.2f}x", f"{r['bound']:.2f}x", *accepted, *(engine_report.cells(r.get("engine")) if engine else [])]
    return "| " + " | ".join(cells) + " |"


def _markdown(merged: dict, folders: list[Path], out_dir: Path) -> str:
    first = next(iter(merged.values()))
    target = first["target"]
    lines = ["# Speculative decoding report", "",
             f"Target {target_label(target)}: G = {target['G']} query heads per KV head, tile {target['tile']} rows, "
             f"D = {target['D']} drafts per verify.", ""]
    if len(folders) > 1:
        lines += ["Rows named `NAME (FOLDER)` come from the report in FOLDER, measured against the target the "
                  "target column names, their speedup against that report's own plain decoding; where the "
                  "targets differ, their tau compares with the others' only as far as the two targets' texts do.", ""]
    lines += [TAU_NOTE, "", "Full reports: " + ", ".join(
        f"[{folder.name}]({os.path.relpath(folder, out_dir)}/report.md)" for folder in folders), ""]
    for label, results in merged.items():
        lines += [f"## {setting_name(results['settings']).capitalize()}", "", text_line(results), ""]
        for other in results["others"]:
            lines += [f"Against {target_label(other['target'])}: " + text_line(other), ""]
        lines += [*_table(results), "",
                  f"![tau]({label}/tau.png) ![speedup]({label}/speedup.png) ![acceptance]({label}/acceptance.png)", ""]
    return "\n".join(lines)
