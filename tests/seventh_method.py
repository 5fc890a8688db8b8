"""A throwaway seventh method, written as design.md's "Adding a method" says a newcomer writes
one, all in this file: a bigram table that drafts a chain of argmax next tokens. It exists so
that tests/test_registry.py can register it in the test process and run train, eval, export
and the serve line on it: if the shared code needed anything more than these pieces and one
`MethodSpec`, that test fails.

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

from draftsmith.eval.proposers.base import Draft
from draftsmith.fields import option
from draftsmith.fsutil import atomic_dir, read_json, write_json
from draftsmith.models.layouts import NATIVE, expect
from draftsmith.models.native import load_drafter, load_native_weights, load_state_strict, save_drafter
from draftsmith.registry import MethodSpec
from draftsmith.train.data_setup import load_tokenizer, packed_corpus
from draftsmith.train.method import TrainMethod

NAME = "bigram"
ARCHITECTURE = "ToyBigram"  # the toy engine's layout


# ---------------------------------------------------------------- models/bigram.py

@dataclass
class BigramConfig:
    vocab_size: int = option(0, "the target's vocabulary (0: the tokenizer's)")
    init_std: float = option(0.02, "standard deviation of the table's initial logits")


class BigramDrafter(nn.Module):
    method = NAME

    def __init__(self, config: BigramConfig):
        super().__init__()
        self.config = config
        self.table = nn.Parameter(torch.randn(config.vocab_size, config.vocab_size) * config.init_std)

    @classmethod
    def from_target(cls, vocab_size: int, **overrides) -> BigramDrafter:
        return cls(BigramConfig(**{"vocab_size": vocab_size, **overrides}))

    def native_state(self) -> dict[str, torch.Tensor]:
        return self.state_dict()

    @classmethod
    def from_native(cls, config, state, target=None, source: str = "") -> BigramDrafter:
        drafter = cls(config)
        load_state_strict(drafter, state, source)
        return drafter

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table[ids]


# ---------------------------------------------------------------- train/bigram.py

class BigramTraining(TrainMethod):
    def __init__(self, recipe, device):
        super().__init__(recipe, device)
        self.tokenizer = load_tokenizer(recipe)
        self.model = self.build_drafter()
        self.train_data = packed_corpus(recipe, self.tokenizer, "train")
        self.eval_data = packed_corpus(recipe, self.tokenizer, "validation")

    def build_drafter(self) -> nn.Module:
        return BigramDrafter.from_target(len(self.tokenizer), **self.recipe.method.params)

    def loss(self, model, batch, step, micro=0, total_steps=0):
        ids = batch["input_ids"]
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        return loss, {"loss_main": loss.item(), "acc_main": (logits.argmax(-1) == ids[:, 1:]).float().mean().item()}

    def tokens_in(self, batch) -> int:
        return int(batch["input_ids"].numel())

    def save(self, model, out_dir: Path) -> Path:
        return save_drafter(model, out_dir / "model")


# ---------------------------------------------------------------- eval/proposers/bigram.py

class BigramProposer:
    capture_layers: tuple[int, ...] = ()

    def __init__(self, drafter: BigramDrafter, target, name: str = NAME):
        self.name, self.drafter, self.last = name, drafter.eval(), None

    def begin(self, prompt_ids, ctx) -> None:
        self.last = prompt_ids[-1:]

    @torch.no_grad()
    def propose(self, max_nodes, sampling, generator) -> Draft:
        tokens, token = [], self.last
        for _ in range(max(0, max_nodes)):
            token = self.drafter(token).argmax(-1)
            tokens.append(token)
        return Draft(torch.cat(tokens)) if tokens else Draft.empty()

    def commit(self, accepted, ctx) -> None:
        self.last = accepted[-1:]


def load_proposer(path, target, **options) -> BigramProposer:
    return BigramProposer(read(path, target), target, **options)


# ---------------------------------------------------------------- models/formats/bigram.py

def read(path, target=None) -> BigramDrafter:
    layout, meta = expect(path, NAME)
    if layout == NATIVE:
        return load_drafter(path, NAME, target)
    config = BigramConfig(vocab_size=meta["vocab_size"])
    return BigramDrafter.from_native(config, load_native_weights(path), source=str(path))


def write_toy(folder, out_dir, dtype=None) -> Path:
    drafter = load_drafter(folder, NAME)
    with atomic_dir(out_dir) as tmp:
        save_file({"table": drafter.table.detach().contiguous()}, str(tmp / "model.safetensors"))
        write_json(tmp / "config.json", {"architectures": [ARCHITECTURE], "vocab_size": drafter.config.vocab_size})
    return Path(out_dir)


def serve(folder, written, fmt, latency_table=None) -> list[str]:
    from draftsmith.models.serve import printed

    vocab = read_json(Path(written) / "config.json")["vocab_size"]
    return printed([f"a toy layout of {vocab} rows"], [f"toy-engine serve --draft {shlex.quote(str(written))}"])


# ---------------------------------------------------------------- the one entry (draftsmith/registry.py)

SPEC = MethodSpec(
    NAME, "a bigram table drafting a chain of argmax tokens (a test's throwaway method)",
    proposer=f"{__name__}:load_proposer", config=f"{__name__}:BigramConfig", model=f"{__name__}:BigramDrafter",
    training=f"{__name__}:BigramTraining", formats=__name__,
    exports={"toy": f"{__name__}:write_toy", "native": "draftsmith.models.export:export_native"},
    foreign_layouts={ARCHITECTURE: "toy"},
)
