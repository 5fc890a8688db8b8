"""What one `draftsmith eval` run is asked: the recipe's eval section plus what only the
command says, each declared once with `option` (cli.py derives the flags from these fields).

No torch here: the command line is built from these declarations before anything heavy loads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from draftsmith.eval.prompts import BENCHMARKS
from draftsmith.fields import option
from draftsmith.recipe import DataSection, EvalSection, TargetSection

# --num-draft: a number, TILE (the tile rule's D: a recipe's null, the settings' None) or AUTO
# (per drafter, eval/auto_draft.py).
TILE = "tile"
AUTO = "auto"
NUM_DRAFT_WORDS = f"a number of at least 1, {TILE} (the tile rule's D) or {AUTO}"
# --cache: the target's KV cache kinds (eval/decoder.py), each with its meaning.
CACHE_KINDS = {"dynamic": "grows", "static": "preallocated, fixed addresses"}


def num_draft_arg(text: str) -> int | str | None:
    """--num-draft's value: a whole number, `tile` (None, as a recipe's null) or `auto`."""
    return None if text == TILE else AUTO if text == AUTO else int(text)


@dataclass
class EvalSettings(EvalSection):
    """The eval section (flags over the recipe's) and the command's own fields; `num_draft`
    may also be AUTO here."""

    dataset: str = option("embedded", "a benchmark by name (" + ", ".join(BENCHMARKS) + "; every user turn), a "
                                      "jsonl of turns/conversations/messages/prompt, a dataset folder or hub name, "
                                      "or 'embedded'")
    temperatures: list[float] = option([], "0 = greedy (checked token for token against plain decoding); one report "
                                           "each (default: the recipe's eval.temperature)")
    drafters: list[str] = option([], "[LABEL=]NAME[:PATH] (LABEL names the report's row; default NAME)")
    latency_table: str = option("", "--num-draft auto: a `draftsmith plan TARGET --measure` table of this device, "
                                    "its folder or latency.json (default: none, eval measures one first)")
    calibration_prompts: int = option(4, "--num-draft auto: prompts, disjoint from the evaluated ones, that "
                                         "calibrate each drafter (each decoded twice: at the cap and at D = 1)")
    prompt_chars: int = option(400, "embedded prompts: characters of held-out source each")
    min_prompt_tokens: int = option(0, "long-context eval: only prompts (a conversation's first turn) of at least "
                                       "this many tokens, drawn from 8x --num-prompts candidates (0: all)")
    cache_kind: str = option("dynamic", "the target's KV cache", choices=CACHE_KINDS)
    compile: bool = option(False, "compile the verify forward (CUDA graphs on CUDA); needs --cache static")
    engine: str = option("", "a serving engine that decodes the same prompts with each drafter as `draftsmith export` "
                             "serves it, its acceptance, speed and greedy check beside ours: vllm (`make engine`, or "
                             "DRAFTSMITH_ENGINE_PYTHON; default: none)")
    engine_layouts: str = option("first", "--engine: each drafter in its method's first vLLM layout (first) or in "
                                          "every layout vLLM loads (all)")
    # Other sections' keys, declared there (their flags too): the tile the drafters were sized
    # for, and the chat settings they were trained with.
    tile: int = TargetSection.tile
    chat_template: str = DataSection.chat_template
    enable_thinking: bool | None = DataSection.enable_thinking
    # Per-run proposer options by method name, {method: {option: value}} (registry.py's decode
    # options, each its own flag).
    proposer_options: dict[str, dict] = field(default_factory=dict)

    def each_temperature(self) -> list[float]:
        """The temperatures reported, one report each: those asked, else the section's."""
        return self.temperatures or [self.temperature]
