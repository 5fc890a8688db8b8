"""A throwaway seventh method, written as design.md's "Adding a method" says a newcomer writes
a post-hoc, exported one, all in this file: a bigram table plus a projection of the frozen
target's hidden state (trained on the target's captured features, as EAGLE-3, DFlash and DSpark
are) that drafts a chain of argmax next tokens. It exists so that tests/test_registry.py can
register it in the test process and run train, eval, export and the serve line on it: if the
shared code needed anything more than these pieces and one `MethodSpec`, that test fails. Its
proposer has a per-run option (`min_prob`, an eval flag) that `--num-draft auto` chooses with D
(`BigramTuning`, the `Proposer.tuning` face) and that the report shows (the tuning's column,
`report_extra`).

Its pieces, each where a real method keeps it: the config and the module (models/<name>.py),
the training (train/<name>.py), the proposer (eval/proposers/<name>.py), the formats
(models/formats/<name>.py): here one module stands for all four.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from draftsmith.errors import DraftsmithError
from draftsmith.eval.proposers.base import Draft, Proposer, Tuned, Tuning
from draftsmith.fields import MethodConfig, option
from draftsmith.fsutil import atomic_dir, read_json, write_json
from draftsmith.models.layouts import NATIVE, expect
from draftsmith.models.native import load_drafter, load_native_weights, load_state_strict
from draftsmith.registry import DecodeOption, MethodSpec
from draftsmith.train.posthoc import PostHocMethod

NAME = "bigram"
ARCHITECTURE = "ToyBigram"  # the toy engine's layout


# ---------------------------------------------------------------- models/bigram.py

@dataclass
class BigramConfig(MethodConfig):
    vocab_size: int = option(0, "the target's vocabulary (0: the target's)")
    hidden_size: int = option(0, "the target's hidden size (0: the target's)")
    target_layer_ids: list[int] = option([], "the one target layer whose hidden state it reads (empty: the last)")
    init_std: float = option(0.02, "standard deviation of the table's initial logits", low=0.0)


class BigramDrafter(nn.Module):
    """Logits of the token after `ids` from the token (a bigram table) and the target's hidden
    state one position back (the latest the decoder has: the bonus token's own comes with the
    next verify, EAGLE's offset)."""

    method = NAME

    def __init__(self, config: BigramConfig):
        super().__init__()
        self.config = config
        self.table = nn.Parameter(torch.randn(config.vocab_size, config.vocab_size) * config.init_std)
        self.proj = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        nn.init.zeros_(self.proj.weight)

    @classmethod
    def from_target(cls, target, **overrides) -> BigramDrafter:
        c = target.config
        keys = {"vocab_size": c.vocab_size, "hidden_size": c.hidden_size, **overrides}
        keys["target_layer_ids"] = list(keys.get("target_layer_ids") or [c.num_hidden_layers - 1])
        return cls(BigramConfig(**keys))

    def native_state(self) -> dict[str, torch.Tensor]:
        return self.state_dict()

    @classmethod
    def from_native(cls, config, state, target=None, source: str = "") -> BigramDrafter:
        drafter = cls(config)
        load_state_strict(drafter, state, source)
        return drafter

    def forward(self, ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.table[ids] + self.proj(hidden.to(self.proj.weight.dtype))

    def loss(self, hidden, input_ids, learn):
        """Position t reads token x_t and the target's hidden state at t - 1, and predicts x_{t+1}
        where `learn` marks it (the answer's tokens)."""
        logits, labels = self(input_ids[:, 1:-1], hidden[:, :-2]), input_ids[:, 2:]
        mask = learn[:, 2:].float()
        ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
        loss = (ce * mask.flatten()).sum() / mask.sum().clamp(min=1)
        acc = ((logits.argmax(-1) == labels).float() * mask).sum() / mask.sum().clamp(min=1)
        return loss, {"loss_main": loss.item(), "acc_main": acc.item()}


# ---------------------------------------------------------------- train/bigram.py

class BigramTraining(PostHocMethod):
    @classmethod
    def drafter_config(cls, target_config, keys, tile):
        c = target_config if isinstance(target_config, dict) else target_config.to_dict()
        return BigramConfig(**{"vocab_size": c["vocab_size"], "hidden_size": c["hidden_size"],
                               "target_layer_ids": [c["num_hidden_layers"] - 1], **keys})

    @classmethod
    def new_drafter(cls, target, keys, tile):
        return BigramDrafter.from_target(target, **keys)

    def build_drafter(self) -> BigramDrafter:
        return self.new_drafter(self.target, self.recipe.method.params, self.recipe.target.tile)

    @classmethod
    def features_of(cls, drafter, out):
        return {"hidden": out.hidden[drafter.config.target_layer_ids[0]]}

    def extract(self, out):
        return self.features_of(self.model.drafter, out)

    @classmethod
    def loss_on(cls, model, target, batch, features, generator=None):
        return model(features["hidden"].float(), batch["input_ids"], batch["loss_mask"] * batch["attention_mask"])

    def loss(self, model, batch, step, micro=0, total_steps=0):
        return self.loss_on(model, self.target, batch, self.features(batch))


# ---------------------------------------------------------------- eval/proposers/bigram.py

def check_min_prob(value, what: str) -> float:
    if not 0.0 <= value < 1.0:
        raise DraftsmithError(f"{what}: {value} is no probability in [0, 1)")
    return float(value)


class BigramProposer(Proposer):
    """`min_prob`: the chain ends before the first draft the table gives less than this
    probability (a per-run option: `eval --min-prob`, or chosen with D by `--num-draft auto`)."""

    run_options = ("min_prob",)

    def __init__(self, drafter: BigramDrafter, target, name: str = NAME, min_prob: float = 0.0):
        self.name, self.drafter, self.last, self.hidden = name, drafter.eval(), None, None
        self.capture_layers = tuple(drafter.config.target_layer_ids)
        self.min_prob = check_min_prob(min_prob, "min_prob")
        # While BigramTuning records: each verified chain's draft probabilities and the drafts kept.
        self.records: list[tuple[list[float], int]] | None = None
        self._pending: list[float] | None = None

    def begin(self, prompt_ids, ctx) -> None:
        self.last, self.hidden, self._pending = prompt_ids[-1:], None, None
        self._take(ctx)

    def _take(self, ctx) -> None:
        """The latest committed position's hidden state the verify computed (one behind the last token)."""
        if len(ctx):
            self.hidden = ctx.hidden[self.capture_layers[0]][-1:]

    @torch.no_grad()
    def propose(self, max_nodes, sampling, generator) -> Draft:
        tokens, probs, token = [], [], self.last
        for _ in range(max(0, max_nodes)):
            prob, token = self.drafter(token, self.hidden).softmax(-1).max(-1)
            if self.records is None and prob.item() < self.min_prob:
                break
            tokens.append(token)
            probs.append(prob.item())
        self._pending = probs if self.records is not None else None  # recording: the whole chain
        return Draft(torch.cat(tokens)) if tokens else Draft.empty()

    def commit(self, accepted, ctx) -> None:
        self.last = accepted[-1:]
        self._take(ctx)
        if self._pending is not None:
            self.records.append((self._pending, len(accepted) - 1))
            self._pending = None

    def report_extra(self) -> dict:
        return {"min_prob": self.min_prob}

    def tuning(self) -> BigramTuning:
        return BigramTuning(self)


MIN_PROBS = (0.01, 0.1, 0.5)  # what `--num-draft auto` tries


class BigramTuning(Tuning):
    """`min_prob` and D chosen together: each recorded pass at the cap priced at the chain
    length every (min_prob, d) would leave."""

    def __init__(self, proposer: BigramProposer):
        self.proposer, self.records = proposer, {}

    def record(self, num_draft: int) -> None:
        self.records[num_draft] = self.proposer.records = []

    def choose(self, pass_ms, max_draft: int) -> Tuned:
        records = self.records.get(max_draft, [])

        def tokens_per_s(min_prob: float, d: int) -> float:
            tokens = ms = 0.0
            for probs, accepted in records:
                length = next((k for k, p in enumerate(probs[:d]) if p < min_prob), min(d, len(probs)))
                tokens, ms = tokens + 1 + min(accepted, length), ms + pass_ms(length)
            return 1000.0 * tokens / ms if ms else 0.0

        rate, min_prob, d = max((tokens_per_s(m, d), m, d) for m in MIN_PROBS for d in range(max_draft + 1))
        return Tuned(d, rate, {"min_prob": min_prob}, {"min_prob": min_prob}, {"min prob": min_prob},
                     "The bigram drafter's min prob is chosen with D on the same calibration passes.")


def load_proposer(path, target, **options) -> BigramProposer:
    return BigramProposer(read(path, target), target, **options)


# ---------------------------------------------------------------- models/formats/bigram.py

def read(path, target=None) -> BigramDrafter:
    layout, meta = expect(path, NAME)
    if layout == NATIVE:
        return load_drafter(path, NAME, target)
    config = BigramConfig(vocab_size=meta["vocab_size"], hidden_size=meta["hidden_size"],
                          target_layer_ids=[meta["target_layer"]])
    return BigramDrafter.from_native(config, load_native_weights(path), source=str(path))


def write_toy(folder, out_dir, dtype=None) -> Path:
    drafter = load_drafter(folder, NAME)
    with atomic_dir(out_dir) as tmp:
        state = {k: v.detach().contiguous() for k, v in drafter.native_state().items()}
        save_file(state, str(tmp / "model.safetensors"))
        c = drafter.config
        write_json(tmp / "config.json", {"architectures": [ARCHITECTURE], "vocab_size": c.vocab_size,
                                         "hidden_size": c.hidden_size, "target_layer": c.target_layer_ids[0]})
    return Path(out_dir)


def serve(folder, written, fmt, latency_table=None) -> list[str]:
    from draftsmith.models.serve import printed

    vocab = read_json(Path(written) / "config.json")["vocab_size"]
    return printed([f"a toy layout of {vocab} rows"], [f"toy-engine serve --draft {shlex.quote(str(written))}"])


# ---------------------------------------------------------------- the one entry (draftsmith/registry.py)

SPEC = MethodSpec(
    NAME, "a bigram table and the target's hidden state drafting a chain of argmax tokens (a test's throwaway method)",
    proposer=f"{__name__}:load_proposer", config=f"{__name__}:BigramConfig", model=f"{__name__}:BigramDrafter",
    training=f"{__name__}:BigramTraining", formats=__name__, reads_target_features=True,
    exports={"toy": f"{__name__}:write_toy", "native": "draftsmith.models.export:export_native"},
    foreign_layouts={ARCHITECTURE: "toy"},
    decode_options=(DecodeOption("min_prob", check=f"{__name__}:check_min_prob", metavar="P",
                                 help="bigram: end a chain before a draft of probability below P (default 0)"),),
)
