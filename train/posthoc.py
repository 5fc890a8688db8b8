"""Shared ground of the drafters trained post hoc against a frozen target (EAGLE-3,
DFlash, DSpark): the target itself, and the target's own answers as training data.

The target is loaded frozen, kept outside the trainable module, and run under no_grad to
capture the features a drafter reads; it never reaches the optimizer or a training wrapper.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from torch import nn

from draftsmith.errors import DraftsmithError
from draftsmith.models.target import TargetOutput, load_target, resolve_model_dir, target_forward
from draftsmith.recipe import Recipe
from draftsmith.train.methods import TrainMethod

EVAL_FRACTION = 0.05


def conversations_file(recipe: Recipe, target, tokenizer) -> tuple[Path | str, bool]:
    """The training conversations, answered by the target when asked (always for the
    embedded default, whose prompts have no answers). Returns (source, plain_text)."""
    from accelerate import PartialState

    from draftsmith.data.conversations import load_conversations
    from draftsmith.data.regenerate import embedded_conversations, regenerate

    data = recipe.data
    embedded = data.dataset == "embedded"
    if not embedded and not data.regenerate:
        return data.dataset, False
    # The settings are in the name: a rerun with the same ones (a resume) reuses the file,
    # other settings never pick up a stale one.
    settings = json.dumps([data.dataset, data.num_conversations, data.prompt_chars, data.regen_max_new_tokens,
                           data.regen_temperature, recipe.train.seed, str(recipe.target.path)])
    key = hashlib.sha256(settings.encode()).hexdigest()[:10]
    out = Path(recipe.train.output_dir) / "data" / f"regenerated-{key}.jsonl"
    with PartialState().main_process_first():  # one process answers; the others read its file
        if not out.is_file():
            conversations = (embedded_conversations(data.num_conversations, data.prompt_chars) if embedded
                             else load_conversations(data.dataset))
            regenerate(target, tokenizer, conversations, out, max_new_tokens=data.regen_max_new_tokens,
                       temperature=data.regen_temperature, seed=recipe.train.seed, plain=embedded)
    return out, embedded


class LossForward(nn.Module):
    """Routes `forward` to the drafter's `loss`, so that the DDP/FSDP/DeepSpeed wrapper
    accelerate puts around the trainable module runs its hooks on the loss computation."""

    def __init__(self, drafter: nn.Module):
        super().__init__()
        self.drafter = drafter

    def forward(self, *args, **kwargs):
        return self.drafter.loss(*args, **kwargs)


class PostHocMethod(TrainMethod):
    """Loads the frozen target and its tokenizer, and the rendered training rows."""

    def __init__(self, recipe: Recipe, device: torch.device):
        super().__init__(recipe, device)
        from transformers import AutoTokenizer

        from draftsmith.data.chat import tokenize_conversations

        if not recipe.target.path:
            raise DraftsmithError(f"method {recipe.method.name} trains against a frozen target: set target.path=")
        self.target_dir = resolve_model_dir(recipe.target.path)
        self.target = load_target(self.target_dir, dtype=recipe.target.dtype, device=device,
                                  attn_implementation=recipe.target.attn_implementation)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.target_dir))
        source, plain = conversations_file(recipe, self.target, self.tokenizer)
        rows = tokenize_conversations(source, self.tokenizer, recipe.train.seq_len, plain=plain)
        n_eval = max(1, round(EVAL_FRACTION * len(rows)))
        if len(rows) < 2:
            raise DraftsmithError(f"data.dataset {recipe.data.dataset!r}: {len(rows)} usable conversation(s); "
                                  "need at least 2 (one held out for evaluation)")
        split = rows.train_test_split(test_size=n_eval, seed=recipe.train.seed, shuffle=True)
        self.train_data = split["train"].with_format("torch")
        self.eval_data = split["test"].with_format("torch")

    @torch.no_grad()
    def features(self, batch: dict[str, torch.Tensor], layer_ids) -> TargetOutput:
        """The frozen target's logits and the outputs of `layer_ids` for a batch."""
        return target_forward(self.target, batch["input_ids"], attention_mask=batch["attention_mask"],
                              capture=layer_ids)

    def tokens_in(self, batch) -> int:
        return int(batch["attention_mask"].sum())
