"""How a token is drawn from logits: one type for the speculative decoder, its drafters and
regeneration (data/reply_decoding.py extends it with a reply's length and stop tokens).
Here, in the core, because it imports no torch: regeneration through servers needs none."""

from __future__ import annotations

from dataclasses import dataclass

from draftsmith.errors import DraftsmithError


@dataclass(frozen=True)
class SamplingParams:
    """Logits processing shared by target and draft. temperature 0 = greedy."""

    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off

    def __post_init__(self):
        if self.temperature < 0:
            raise DraftsmithError(f"sampling temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise DraftsmithError(f"sampling top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise DraftsmithError(f"sampling top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = SamplingParams()
