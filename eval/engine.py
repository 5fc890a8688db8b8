"""The serving engine beside our decoder (`draftsmith eval --engine vllm`): vLLM serves the
target with each drafter as `draftsmith export` prints it, decodes the prompts our decoder
decoded, and its acceptance, speed and greedy tokens go into the report beside ours.

vLLM lives in an environment of its own (it pins a transformers below ours): `make engine`
builds one in .venv/engine, DRAFTSMITH_ENGINE_PYTHON names any other Python that imports vllm
(a CUDA build on a GPU node), and DRAFTSMITH_ENGINE_ARGS sets every server's extra flags
(server_flags: --enforce-eager on a CPU build unless set). Each
drafter gets its own server (a speculative config is fixed at start), started with the exact
line export prints for its folder, D set to the report's; a plain server gives the engine's
own tokens/s without a drafter. Prompts go as the
token ids our decoder read (rendered by the chat template, every turn), one request at a time
(batch 1, as ours), the stop tokens ours stopped at.

The engine's figures come from its own counters (/metrics, `vllm:spec_decode_*`), differenced
around each setting's requests: tau is committed tokens over target passes as ours counts it
(a pass with no draft, as n-gram lookup leaves when nothing matches, counts as one token), and
`mean_acceptance_length` is vLLM's own 1 + accepted / drafts (it counts only passes that
drafted). A start that fails, a refusal or a crash is one line in that drafter's row; the rest
of the report is kept.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith.data.local_server import loopback_get, why_it_failed
from draftsmith.data.vllm_server import (  # noqa: F401 - re-exported: callers and tests read them here
    ENGINE_ARGS,
    ENGINE_PYTHON,
    ENGINES,
    Served,
    VllmServer,
    check_engine_name,
    engine_build,
    engine_python,
    server_flags,
)
from draftsmith.errors import DraftsmithError, first_lines
from draftsmith.eval.report import PLAIN

ENGINE_LAYOUTS = ("first", "all")  # each drafter in its method's first vLLM layout, or in every one
log = logging.getLogger(__name__)


def check_engine(settings) -> dict:
    """The engine's build (engine_build), once --engine and --engine-layouts are known to be
    choices and its Python imports vllm: before any decoding."""
    check_engine_name(settings.engine, "eval")
    if settings.engine_layouts not in ENGINE_LAYOUTS:
        raise DraftsmithError(f"eval: --engine-layouts must be one of {', '.join(ENGINE_LAYOUTS)}, "
                              f"got {settings.engine_layouts!r}")
    return engine_build(engine_python())


def parse_vllm_line(line: str) -> tuple[str, str, dict]:
    """(model, dtype, speculative config) of a `vllm serve MODEL --dtype D --speculative-config JSON` line."""
    words = shlex.split(line)
    at = words.index("serve")
    flags = dict(zip(words[at + 2::2], words[at + 3::2]))
    return words[at + 1], flags.get("--dtype", "auto"), json.loads(flags["--speculative-config"])


_METRIC = re.compile(r"^(vllm:[a-z_]+)(\{[^}]*\})? ([0-9.eE+-]+|NaN)$")
DRAFTS = "vllm:spec_decode_num_drafts_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
# The engine's steps: a histogram of tokens per iteration, one observation per step.
STEPS = "vllm:iteration_tokens_total_count"


def read_counters(url: str) -> dict:
    """vLLM's counters (each summed over its labels, the accepted tokens per position apart):
    drafts, accepted drafts, the engine's steps."""
    out: dict = {"per_pos": {}}
    for line in loopback_get(f"{url}/metrics").splitlines():
        found = _METRIC.match(line.strip())
        if not found:
            continue
        name, labels, value = found.group(1), found.group(2) or "", float(found.group(3))
        if name == PER_POSITION:
            pos = int(re.search(r'position="(\d+)"', labels).group(1))
            out["per_pos"][pos] = out["per_pos"].get(pos, 0.0) + value
        elif name.endswith(("_total", "_count")):
            out[name] = out.get(name, 0.0) + value
    return out


def figures(after: dict, before: dict, outputs: list[list[int]], num_draft: int) -> dict:
    """The engine's tau, vLLM's mean acceptance length and per-position acceptance between two
    counter readings, over `outputs` decoded one request at a time. The passes are the engine's
    steps less one prefill a request: vLLM's accepted counter also counts drafts accepted past a
    stop token or the token limit, which the output (and ours) does not keep, so passes are not
    derived from it; without the steps histogram they are (committed less accepted)."""
    def delta(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    committed = sum(max(0, len(o) - 1) for o in outputs)  # the prefill's token is no pass's
    accepted, drafts, steps = delta(ACCEPTED), delta(DRAFTS), delta(STEPS)
    passes = max(1.0, steps - len(outputs) if steps else committed - accepted)
    per_pos = [(after["per_pos"].get(k, 0.0) - before["per_pos"].get(k, 0.0)) / passes for k in range(num_draft)]
    return {"tau": committed / passes, "verify_passes": int(passes), "drafts": int(drafts),
            "accepted_tokens": int(accepted), "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            "per_position_acceptance": per_pos}


def sampling_body(settings: dict) -> dict:
    """The request's sampling, as our report's settings say (vLLM: top_k 0 and top_p 1 are off);
    greedy says temperature 0 alone, which is all greedy decoding reads."""
    if not settings["temperature"]:
        return {"temperature": 0.0}
    return {"temperature": settings["temperature"], "top_p": settings.get("top_p") or 1.0,
            "top_k": settings.get("top_k") or 0}


@dataclass
class Decoded:
    outputs: list[list[int]] = field(default_factory=list)
    seconds: float = 0.0
    steps: list[list[int] | None] = field(default_factory=list)  # per prompt: drafts accepted per drafting pass

    @property
    def tokens_per_s(self) -> float:
        return sum(len(o) for o in self.outputs) / max(self.seconds, 1e-9)


def decode(client, model: str, results: dict, stop: list[int]) -> Decoded:
    """Every prompt of a report's setting, one request at a time, seeded as ours (seed + i)."""
    settings = results["settings"]
    body = {**sampling_body(settings), "stop_token_ids": stop, "return_token_ids": True}
    done = Decoded()
    for i, prompt in enumerate(results["prompts"]):
        start = time.perf_counter()
        reply = client.completions.create(model=model, prompt=prompt["prompt_ids"], max_tokens=settings["max_new_tokens"],
                                          seed=settings["seed"] + i, extra_body=body)
        done.seconds += time.perf_counter() - start
        done.outputs.append(list(reply.choices[0].token_ids))
        spec = ((reply.model_extra or {}).get("metrics") or {}).get("speculative_decoding") or {}
        done.steps.append(spec.get("per_step_accepted"))
    return done


def _starts(accepted: list[int]) -> dict[int, int]:
    """Each pass but the last by the tokens written before it: {position: drafts accepted}."""
    starts, position = {}, 0
    for a in accepted[:-1]:
        starts[position] = a
        position += a + 1
    return starts


def step_differences(theirs: list[list[int] | None], ours: list[list[int]]) -> dict | None:
    """Where the engine's drafts were accepted otherwise than ours, pass by pass. Passes are
    matched by where they start (the tokens written before them), so one pass accepted
    otherwise counts once, not again for every pass after it: passes_compared start at the
    same place in both, passes_differing of them accepted otherwise, passes_out_of_step have no
    counterpart (the engine catching up with us or we with it). Each prompt's last pass is left
    out: the engine counts drafts accepted past the stop or the limit there, ours does not.
    None where the engine gave no steps."""
    if any(t is None for t in theirs):
        return None
    compared = differing = out_of_step = 0
    first = None
    for i, (t, o) in enumerate(zip(theirs, ours)):
        t, o = _starts(t), _starts(o)
        common = sorted(t.keys() & o.keys())
        compared += len(common)
        out_of_step += len(t) + len(o) - 2 * len(common)
        for position in common:
            if t[position] != o[position]:
                differing += 1
                first = first or {"prompt": i, "position": position, "ours": o[position], "engine": t[position]}
    return {"passes_compared": compared, "passes_differing": differing, "passes_out_of_step": out_of_step,
            "first_difference": first}


def same_tokens(theirs: list[list[int]], ours: list[list[int]], stop: set[int]) -> list[bool]:
    """Per prompt, whether the engine wrote our tokens (each cut after its first stop token:
    whether a stop token is returned is the engine's convention, not a different answer)."""
    from draftsmith.eval.decoding import stop_at  # here: the CLI imports this module without torch

    return [list(a[:stop_at(a, stop) + 1]) == list(b[:stop_at(b, stop) + 1]) for a, b in zip(theirs, ours)]


def served_for(arg: str, num_draft: int, work: Path, every_layout: bool) -> list[Served]:
    """How vLLM serves the drafter a `--drafter` argument names, D = `num_draft`: in each layout
    its method declares (registry: `vllm_layouts`, the first unless `every_layout`), by the line
    `draftsmith export` prints for that layout; or by the method's own config (`vllm_config`)."""
    from draftsmith.eval.proposers import parse_drafter_arg
    from draftsmith.registry import proposer_names

    name, path = parse_drafter_arg(arg)
    spec, options = proposer_names()[name]
    if name != spec.name and name not in spec.vllm_variants:
        return [Served("-", refused=f"vLLM drafts {spec.name}'s checkpoint only as {spec.name} drafts it; "
                                    f"the {name} variant has no engine equivalent")]
    if spec.vllm_config:
        config, note = spec.load("vllm_config")(path, num_draft, options)
        return [Served(config["method"], speculative_config=config, note=note)]
    layouts = spec.vllm_layouts if every_layout else spec.vllm_layouts[:1]
    if not layouts:
        return [Served("-", refused=f"vLLM serves no layout of {spec.name} that draftsmith writes")]
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", arg)
    return [_exported(path, fmt, num_draft, work / f"{safe}-{fmt}") for fmt in layouts]


def _exported(run: Path, fmt: str, num_draft: int, out: Path) -> Served:
    """`fmt` written by `draftsmith export` and served by the vLLM line it prints, D = `num_draft`."""
    from draftsmith.models.export import export_notes, export_run

    try:
        written = export_run(run, fmt, out)
        lines = [line.strip() for line in export_notes(run, fmt, written) if line.strip().startswith("vllm serve")]
    except DraftsmithError as exc:
        return Served(fmt, refused=f"draftsmith export --format {fmt}: {exc}")
    if not lines:
        return Served(fmt, refused=f"draftsmith export --format {fmt} prints no vLLM line")
    model, dtype, config = parse_vllm_line(lines[0])
    return Served(fmt, model, dtype, {**config, "num_speculative_tokens": num_draft})


@dataclass
class Engine:
    """One eval's engine: its build (engine_build: its interpreter too), the target, and where
    its servers log."""
    build: dict
    target_dir: Path
    work: Path
    max_model_len: int
    stop: list[int]
    starts: int = 0

    failed: bool = False

    def clean_up(self) -> None:
        """The exports go; the servers' logs stay only where one failed (its refusal names its log)."""
        import shutil

        if not self.failed:
            shutil.rmtree(self.work, ignore_errors=True)
            return
        for path in self.work.iterdir():
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
        log.warning("vLLM: the logs of its servers are kept in %s", self.work)

    def label(self) -> str:
        return f"vllm {self.build['version']} ({self.build['device']})"

    def run(self, served: Served, runs: list[dict]) -> list[dict]:
        """`served` started once, every setting of `runs` decoded on it: one record per run
        (the refusal line in each where it did not start or died)."""
        from openai import OpenAI, OpenAIError

        from draftsmith.models.serve import engine_args

        flags = server_flags(self.build)
        head = {"engine": self.label(), "layout": served.layout, **({"server_flags": flags} if flags else {}),
                **({"speculative_config": served.speculative_config} if served.speculative_config else {}),
                **({"note": served.note} if served.note else {})}
        if served.refused:
            return [{**head, "refused": served.refused} for _ in runs]
        model = served.model or str(self.target_dir)
        dtype = served.dtype or engine_args(self.target_dir)[1]
        self.starts += 1
        log_path = self.work / f"server-{self.starts}.log"
        start = time.perf_counter()
        try:
            with VllmServer(self.build["python"], dataclasses.replace(served, model=model, dtype=dtype),
                            log_path, self.max_model_len, per_step=self.build["per_step"],
                            flags=flags) as server:
                head["start_s"] = round(time.perf_counter() - start, 1)
                client = OpenAI(base_url=f"{server.url}/v1", api_key="EMPTY", timeout=1800, max_retries=0)
                warm = {**runs[0], "prompts": runs[0]["prompts"][:1],
                        "settings": {**runs[0]["settings"], "max_new_tokens": 4}}
                decode(client, model, warm, self.stop)  # first requests pay one-off costs
                return [self._setting(server, client, model, results, head, log_path) for results in runs]
        except (DraftsmithError, OpenAIError) as exc:  # it did not start, or died warming up
            why = str(exc) if isinstance(exc, DraftsmithError) else why_it_failed(log_path, first_lines(exc))
            log.warning("vLLM, %s: %s", served.layout, why)
            self.failed = True
            return [{**head, "refused": why} for _ in runs]

    def _setting(self, server, client, model: str, results: dict, head: dict, log_path: Path) -> dict:
        """One setting's record, or the engine's reason where a request of it failed (a crash
        at one temperature leaves the others' records, read while the server still runs)."""
        from openai import OpenAIError

        try:
            return self._measure(server, client, model, results, head)
        except OpenAIError as exc:
            why = why_it_failed(log_path, first_lines(exc))
            log.warning("vLLM, %s, temperature %g: %s", head["layout"], results["settings"]["temperature"], why)
            self.failed = True
            return {**head, "refused": f"{why} (log: {log_path})"}

    def _measure(self, server, client, model: str, results: dict, head: dict) -> dict:
        before = read_counters(server.url)
        done = decode(client, model, results, self.stop)
        after = read_counters(server.url)
        record = {**head, "tokens_per_s": done.tokens_per_s, "outputs": done.outputs, "steps": done.steps}
        config = head.get("speculative_config")
        if config:
            record.update(figures(after, before, done.outputs, int(config["num_speculative_tokens"])))
        return record


def compare(record: dict, ours: list[list[int]], results: dict, stop: set[int],
            our_steps: list[list[int]] | None = None) -> dict:
    """`record` with its greedy check against our outputs (None when sampling: the engine's
    random draws are its own), greedy, where every pass drafted, its passes against ours
    step by step, and without its raw outputs."""
    outputs, steps = record.pop("outputs", None), record.pop("steps", None)
    if outputs is None:
        return record
    same = same_tokens(outputs, ours, stop)
    greedy = results["settings"]["temperature"] == 0
    record["greedy_equal"] = all(same) if greedy else None
    record["prompts_equal"] = f"{sum(same)}/{len(same)}"
    if greedy and our_steps is not None and steps and record.get("drafts") == record.get("verify_passes"):
        record["step_check"] = step_differences(steps, our_steps)
    return record


def add_engine_columns(runs: list[dict], settings, target_dir: Path, build: dict) -> None:
    """The engine's columns in every report of one eval (`runs`, one per temperature): plain
    decoding's in each `plain`, and each drafter's under `engine` (its method's first vLLM
    layout) and `engine_<layout>` (the others, with `--engine-layouts all`)."""
    import tempfile

    stop = sorted(runs[0]["settings"]["stop_token_ids"])
    longest = max(len(p["prompt_ids"]) for r in runs for p in r["prompts"])
    most = max([d["num_draft"] for r in runs for d in r["drafters"]] + [0])
    engine = Engine(build, Path(target_dir), Path(tempfile.mkdtemp(prefix="draftsmith-engine-")),
                    max_model_len=longest + settings.max_new_tokens + most + 8, stop=stop)
    try:
        log.info("%s: plain decoding", engine.label())
        for results, record in zip(runs, engine.run(Served("plain"), runs)):
            ours = [p["outputs"][PLAIN] for p in results["prompts"]]
            results[PLAIN]["engine"] = compare(record, ours, results, set(stop))
        for i, arg in enumerate(settings.drafters):
            _serve_drafter(engine, runs, i, arg, settings.engine_layouts == "all")
    finally:
        engine.clean_up()


def _serve_drafter(engine: Engine, runs: list[dict], i: int, arg: str, every_layout: bool) -> None:
    by_d: dict[int, list[dict]] = {}  # --num-draft auto may choose another D per temperature
    for results in runs:
        by_d.setdefault(results["drafters"][i]["num_draft"], []).append(results)
    for num_draft, group in by_d.items():
        for n, served in enumerate(served_for(arg, num_draft, engine.work, every_layout)):
            log.info("%s: %s as %s", engine.label(), arg, served.layout)
            for results, record in zip(group, engine.run(served, group)):
                row = results["drafters"][i]
                ours = [p["outputs"][row["name"]] for p in results["prompts"]]
                our_steps = [p["accepted"][row["name"]] for p in results["prompts"]]
                record = compare(record, ours, results, set(engine.stop), our_steps)
                plain = results[PLAIN]["engine"].get("tokens_per_s")
                if record.get("tokens_per_s") and plain:
                    record["speedup"] = record["tokens_per_s"] / plain
                row["engine" if n == 0 else f"engine_{served.layout}"] = record
