"""Which share of a data-preparation job this process does under `accelerate launch`.

Regeneration and feature caching split their work into units (batches, shards) dealt
round-robin to the processes; each process writes its units to its own files, and the main
process merges them in unit order once all are done. A unit's result does not depend on
which process computed it (its seed is its position), so the merged output is the one a
single process writes. The files of all processes must be visible to the main process: one
machine, or a shared filesystem.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


def _no_wait() -> None:
    return None


@dataclass(frozen=True)
class Processes:
    rank: int = 0
    world: int = 1
    barrier: Callable[[], None] = field(default=_no_wait, compare=False)  # every process waits for all
    device: str | None = None  # this process's accelerator under a launch (None: the caller's choice)

    @property
    def main(self) -> bool:
        return self.rank == 0

    def mine(self, unit: int) -> bool:
        return unit % self.world == self.rank


def current_processes() -> Processes:
    """This process's place in an `accelerate launch` (one process of one when not launched)."""
    import torch
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    # Only AcceleratorState reads ACCELERATE_USE_CPU; a process that has no Accelerator yet
    # (the data commands) must say it, or a CPU launch looks like one process of one.
    # The first PartialState of a process decides; later ones share it.
    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU") or not torch.cuda.is_available())
    if state.num_processes == 1:
        return Processes()
    device = str(state.device) if state.device.type == "cuda" else None
    return Processes(state.process_index, state.num_processes, state.wait_for_everyone, device)
