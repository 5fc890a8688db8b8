"""The decoder adapter for DSpark: DFlash's block (`dflash.py`), then the serial refiner.

The refiner runs left to right over the drafted tokens, and the draft may end before the
first position whose own confidence is below a threshold (DeepSpec's rule; default 0, the
full block); the adapter counts those early stops and the verify rows they saved
(`report_extra()`). `eval --num-draft auto` chooses the threshold together with D
(`DSparkTuning`, its `tuning()`).
"""

from __future__ import annotations

import torch

from draftsmith.eval.proposers.base import Draft, SamplingParams, Tuned, Tuning
from draftsmith.eval.proposers.dflash import DFlashProposer, on_target_device
from draftsmith.eval.sampling import draw
from draftsmith.models.dspark import DSparkDrafter, check_threshold
from draftsmith.models.dspark_calibration import best_threshold


class DSparkProposer(DFlashProposer):
    """`confidence_threshold`: None takes the checkpoint's, 0 always drafts the full block
    (`draftsmith eval --confidence-threshold` sets it per run; `--num-draft auto` chooses it).
    `refiner=False` drafts with the backbone alone (an ablation; the result stays exact)."""

    run_options = ("confidence_threshold",)

    def __init__(self, drafter: DSparkDrafter, target, name: str = "dspark",
                 confidence_threshold: float | None = None, refiner: bool = True):
        super().__init__(drafter, target, name)
        # The checkpoint's own value was checked when its config was read; a value given here is checked once.
        self.confidence_threshold = (float(drafter.config.confidence_threshold) if confidence_threshold is None
                                     else check_threshold(confidence_threshold))
        self.refiner = refiner
        self.proposals = 0  # proposals that asked for at least one draft
        self.early_stops = 0  # of those, ended early by the confidence head
        self.rows_saved = 0  # verify rows those early stops did not spend
        # `eval --num-draft auto` (DSparkTuning): with a list here, each verify pass's draft
        # confidences and the drafts it accepted, to price every threshold from one calibration.
        self.confidence_records: list[tuple[list[float], int]] | None = None
        self._pending: list[float] | None = None

    @torch.no_grad()
    def propose(self, max_nodes: int, sampling: SamplingParams, generator: torch.Generator | None) -> Draft:
        if max_nodes <= 0:
            return Draft.empty(self.device)
        hidden, base = self.draft_block(max_nodes)
        probs: list[torch.Tensor] = []

        def pick(logits: torch.Tensor, k: int) -> torch.Tensor:
            token, q = draw(logits, sampling, generator)
            if q is not None:
                probs.append(q)
            return token

        recording = self.confidence_records is not None  # then the whole block: every threshold is priced
        threshold = 0.0 if recording else self.confidence_threshold
        tokens, _, confidence = self.drafter.refine(hidden, base, self.last, pick, self.refiner, threshold)
        self._pending = confidence[0].float().sigmoid().tolist() if recording else None
        self.proposals += 1
        if tokens.shape[1] < hidden.shape[1]:
            self.early_stops += 1
            self.rows_saved += hidden.shape[1] - tokens.shape[1]
        return Draft(tokens[0], None, torch.cat(probs) if probs else None)

    def begin(self, prompt_ids: torch.Tensor, ctx) -> None:
        super().begin(prompt_ids, ctx)
        self._pending = None  # a sequence's last draft, never verified (it hit the token limit), is no record

    def commit(self, accepted: torch.Tensor, ctx) -> None:
        super().commit(accepted, ctx)
        if self._pending is not None:  # the pass that verified the recorded draft: drafts kept = tokens - 1
            self.confidence_records.append((self._pending, len(accepted) - 1))
            self._pending = None

    def report_extra(self) -> dict:
        return {
            "confidence_threshold": self.confidence_threshold,
            "proposals": self.proposals,
            "early_stops": self.early_stops,
            "early_stop_rate": self.early_stops / self.proposals if self.proposals else 0.0,
            "verify_rows_saved": self.rows_saved,
        }

    def tuning(self) -> DSparkTuning:
        return DSparkTuning(self)


class DSparkTuning(Tuning):
    """D and the confidence threshold chosen together: while it records, the drafter drafts whole
    blocks, and each pass of the calibration at the cap prices every threshold
    (models/dspark_calibration.py: best_threshold)."""

    NOTE = ("A drafter that can end a draft early (DSpark's confidence head) gets D and its confidence threshold "
            "together: each calibration pass is priced at the draft length the threshold leaves; its prediction "
            "at the tile rule's D drafts every block in full (threshold 0).")

    def __init__(self, proposer: DSparkProposer):
        self.proposer = proposer
        self.records: dict[int, list[tuple[list[float], int]]] = {}

    def record(self, num_draft: int) -> None:
        self.records[num_draft] = self.proposer.confidence_records = []

    def choose(self, pass_ms, max_draft: int) -> Tuned:
        pair = best_threshold(self.records.get(max_draft, []), pass_ms, max_draft)
        threshold = pair["confidence_threshold"]
        return Tuned(pair["num_draft"], pair["tokens_per_s"], {"confidence_threshold": threshold},
                     {"confidence_threshold": threshold, "threshold_curve": pair["curve"]},
                     {"threshold": threshold}, self.NOTE)


def load_proposer(path, target, **options) -> DSparkProposer:
    """From a DSpark checkpoint in any layout we read (models/formats/dspark.py)."""
    from draftsmith.models.formats.dspark import read

    return DSparkProposer(on_target_device(read(path, target), target), target, **options)
