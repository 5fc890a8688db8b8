"""Trackers as their users expect them: wandb online wherever wandb finds credentials
(`wandb login`'s netrc entry, `WANDB_API_KEY`), offline where it finds none or when the
recipe asks (`tracking.mode`); a resumed run continues the same tracker run; the run's name
and its resolved recipe are logged.

wandb: the run id is kept in the run folder (`tracking.json`) and handed back to `wandb.init`
with `resume="allow"` when the run resumes, so its curves continue in one wandb run.
tensorboard: the event files stay in `RUN/logs/<project>`, and a resumed run purges the
events an interrupted run wrote past its checkpoint (as metrics.jsonl is truncated).
"""

from __future__ import annotations

import json
import logging
import netrc
import os
import secrets
import string
from pathlib import Path
from urllib.parse import urlsplit

from draftsmith.errors import DraftsmithError
from draftsmith.fsutil import atomic_file
from draftsmith.recipe import Recipe, recipe_to_dict

log = logging.getLogger(__name__)

TRACKERS = ("wandb", "tensorboard", "none")
MODES = ("auto", "online", "offline")
TRACKING_FILE = "tracking.json"


def check_tracking(report_to: str, mode: str) -> None:
    if report_to not in TRACKERS:
        raise DraftsmithError(f"tracking.report_to: expected {', '.join(TRACKERS)}, got {report_to!r}")
    if mode not in MODES:
        raise DraftsmithError(f"tracking.mode: expected {', '.join(MODES)}, got {mode!r}")


def wandb_host() -> str:
    return os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai"


def wandb_logged_in() -> bool:
    """Whether wandb finds credentials where it looks for them: the environment
    (WANDB_API_KEY, or an identity token file), then the netrc file `wandb login` writes
    ($NETRC or ~/.netrc) for the server's host."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    try:  # wandb's own reader, where this wandb has it (host aliases, parse warnings)
        from wandb.sdk.lib.wbauth import read_netrc_auth
    except ImportError:
        read_netrc_auth = None
    if read_netrc_auth is not None:
        try:
            return bool(read_netrc_auth(host=wandb_host()))
        except Exception:  # a malformed entry: wandb.init would report it; run offline meanwhile
            return False
    path = os.environ.get("NETRC") or os.path.expanduser("~/.netrc")
    try:
        entry = netrc.netrc(path).authenticators(urlsplit(wandb_host()).netloc)
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(entry and entry[2])


def wandb_mode(mode: str) -> str | None:
    """The `mode` handed to wandb.init; None leaves it to a WANDB_MODE the user set."""
    if mode != "auto":
        return mode
    if os.environ.get("WANDB_MODE"):
        return None
    if wandb_logged_in():
        return "online"
    log.info("wandb: no credentials found (wandb login, WANDB_API_KEY): the run is logged offline; "
             "`wandb sync` uploads it later")
    return "offline"


def wandb_run_id(out_dir: Path, resuming: bool) -> str:
    """The run's wandb id: the stored one when resuming, else a new one, stored first."""
    path = out_dir / TRACKING_FILE
    if resuming and path.is_file():
        try:
            stored = json.loads(path.read_text()).get("wandb_id")
        except (ValueError, AttributeError):
            stored = None
        if stored:
            return stored
    run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
    with atomic_file(path) as f:
        json.dump({"wandb_id": run_id}, f)
    return run_id


def start_trackers(accelerator, tracking, out_dir: Path, config: dict, recipe_text: str, resume_step: int | None):
    """`accelerator.init_trackers` for `tracking` (the recipe section); main process only.
    `resume_step`: the checkpoint's step when the run resumes, else None."""
    if tracking.report_to == "none":
        return
    name = tracking.run_name or out_dir.name
    if tracking.report_to == "wandb":
        kwargs = {"name": name, "dir": str(out_dir), "id": wandb_run_id(out_dir, resume_step is not None),
                  "resume": "allow"}
        mode = wandb_mode(tracking.mode)
        if mode is not None:
            kwargs["mode"] = mode
        log.info("wandb: run %s, id %s (%s%s)", name, kwargs["id"], mode or "WANDB_MODE",
                 ", resumed" if resume_step is not None else "")
        accelerator.init_trackers(tracking.project, config=config, init_kwargs={"wandb": kwargs})
        return
    if tracking.mode == "online":
        raise DraftsmithError("tracking.mode=online: tensorboard writes local files only (use auto or offline)")
    # Events past the checkpoint are the interrupted run's: a resumed run writes them again.
    kwargs = {"purge_step": resume_step + 1} if resume_step is not None else {}
    accelerator.init_trackers(tracking.project, config=config, init_kwargs={"tensorboard": kwargs})
    writer = accelerator.get_tracker("tensorboard", unwrap=True)
    writer.add_text("run", f"{name}\n\n```yaml\n{recipe_text}```", global_step=resume_step or 0)


def log_metrics(accelerator, history: Path, step: int, logs: dict[str, float]) -> None:
    """One step's metrics to the trackers and, on the main process, a line of metrics.jsonl."""
    if not logs:
        return
    accelerator.log(logs, step=step)
    if accelerator.is_main_process:
        with history.open("a") as f:
            f.write(json.dumps({"step": step, **logs}) + "\n")


def truncate_history(history: Path, step: int) -> None:
    """metrics.jsonl without the lines past `step`: what an interrupted run logged after the
    checkpoint a resume continues from."""
    if not history.is_file():
        return
    lines = history.read_text(errors="replace").splitlines()
    keep = []
    for number, line in enumerate(lines, start=1):
        try:
            row_step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            if number == len(lines):  # the line an interruption cut short
                break
            raise DraftsmithError(f"{history}:{number}: not a metrics record; remove the line to resume") from None
        if row_step <= step:
            keep.append(line)
    with atomic_file(history) as f:
        f.write("".join(line + "\n" for line in keep))


def tracker_config(recipe: Recipe) -> dict:
    """The recipe as one flat mapping of scalars, as trackers take a run's config."""
    flat = {}
    for section, values in recipe_to_dict(recipe).items():
        for k, v in values.items():
            flat[f"{section}.{k}"] = v if isinstance(v, (int, float, str, bool)) else str(v)
    return flat
