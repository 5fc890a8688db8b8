"""An export drafts in its reader as it drafts here: "overfit, export, serve, accept" as far
as a CPU runs it. A DFlash and a DSpark drafter are trained a few steps on the target's own
greedy continuation of a prompt (a random drafter accepts nothing and proves nothing), exported
in every layout we write whose reference class imports on CPU, and decoded by our lossless
decoder twice on the same prompt ids, greedy: once with our forward, once with the block
computed by the reader's own class (z-lab's `DFlashDraftModel`, SpecForge's `DFlashDraftModel`
and `DSparkDraftModel`, speculators' `DFlashDraftModel` and `DSparkDraftModel`). The
first-position acceptance and tau must be equal, and above plain decoding's.

Not covered here: DeepSpec (not on PyPI, its class does not import), EAGLE-3 (the reference
forwards are training forwards, teacher-forced across TTT steps, not a drafting loop), and what
only a GPU engine run adds (the engines' own kernels, capture hooks and schedulers; README)."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen3Config

from draftsmith.eval.decoder import SpeculativeDecoder
from draftsmith.eval.proposers.base import Draft
from draftsmith.eval.proposers.dflash import DFlashProposer
from draftsmith.eval.proposers.dspark import DSparkProposer
from draftsmith.models.dflash import concat_layers
from draftsmith.models.export import export_run
from draftsmith.models.native import save_drafter
from draftsmith.models.target import target_forward
from reference_impls import reference, reference_model
from tiny_models import MASK, VOCAB, dflash, dspark

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def sequence(target):
    """A prompt and the target's greedy continuation of it: what the drafters overfit."""
    prompt = torch.randint(0, MASK, (10,), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        full = target.generate(prompt[None], max_new_tokens=NEW_TOKENS, do_sample=False,
                               attention_mask=torch.ones(1, 10, dtype=torch.long))
    return prompt, full


def overfit(drafter, target, full, steps=40):
    """A few Adam steps of the drafter's own loss on one sequence (its answer part)."""
    out = target_forward(target, full, capture=drafter.config.target_layer_ids)
    feats = concat_layers(out.hidden, drafter.config.target_layer_ids).detach()
    mask = torch.zeros_like(full)
    mask[:, 9:] = 1
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    extra = (out.logits.detach(),) if hasattr(drafter, "markov_head") else ()
    drafter.train()
    optimizer = torch.optim.Adam([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        loss, _ = drafter.loss(feats, full, mask, embed, head, *extra, generator=gen)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return drafter.eval()


@pytest.fixture(scope="module")
def trained(target, target_dir, sequence, tmp_path_factory):
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("overfit")
    made = {}
    for name, drafter in (("dflash", dflash(target)), ("dspark", dspark(target, block_size=6))):
        made[name] = save_drafter(overfit(drafter, target, sequence[1]), root / name,
                                  extra={"target": str(target_dir)})
    return made


class ReaderBlock:
    """Our decoder's adapter with the block's hidden states computed by a reader's class; the
    decoder, the target, the context and the acceptance rule stay ours."""

    def __init__(self, block_fn, bias_fn=None):
        self.block_fn, self.bias_fn, self.features = block_fn, bias_fn, None

    def begin(self, prompt_ids, ctx):
        self.features = None
        super().begin(prompt_ids, ctx)  # ours: it calls _extend below

    def _extend(self, ctx):
        new = concat_layers(ctx.hidden, self.drafter.config.target_layer_ids)[None]
        self.features = new if self.features is None else torch.cat([self.features[:, :ctx.start], new], 1)

    def draft_block(self, max_nodes):
        n = min(max_nodes, self.drafter.drafts_per_block)
        ids = torch.full((1, self.drafter.config.block_size), MASK)
        ids[0, 0] = self.last[0]
        with torch.no_grad():
            hidden = self.block_fn(self.features, ids, self.embed(ids))
        first = self.drafter.first_prediction_slot
        hidden = hidden[:, first:first + n]
        return hidden, self.head(hidden)


class ReaderDFlash(ReaderBlock, DFlashProposer):
    def __init__(self, drafter, target, block_fn):
        DFlashProposer.__init__(self, drafter, target, name="reader")
        ReaderBlock.__init__(self, block_fn)


class ReaderDSpark(ReaderBlock, DSparkProposer):
    def __init__(self, drafter, target, block_fn, bias_fn):
        DSparkProposer.__init__(self, drafter, target, name="reader")
        ReaderBlock.__init__(self, block_fn, bias_fn)

    @torch.no_grad()
    def propose(self, max_nodes, sampling, generator):
        hidden, base = self.draft_block(max_nodes)
        prev, tokens = self.last, []
        for k in range(hidden.shape[1]):  # the reader's refiner, left to right, greedy
            prev = (base[:, k] + self.bias_fn(prev, hidden[:, k])).argmax(-1)
            tokens.append(prev)
        return Draft(torch.cat(tokens), None, None)


def zlab_block(model):
    """z-lab's and SpecForge's forward: context features and the block, positions 0 .. a + B - 1."""
    return lambda feats, ids, embeds: model(position_ids=torch.arange(feats.shape[1] + ids.shape[1])[None],
                                           noise_embedding=embeds, target_hidden=feats)


def speculators_block(model):
    """speculators' training forward with one anchor: the only loss-masked position, followed
    by a block's worth of padding its mask keeps the block from seeing."""
    def block(feats, ids, embeds):
        a, size = feats.shape[1], ids.shape[1]
        hidden_states = torch.cat([feats, feats.new_zeros(1, size + 1, feats.shape[2])], 1)
        input_ids = torch.zeros(1, a + size + 1, dtype=torch.long)
        input_ids[0, a] = ids[0, 0]
        loss_mask = torch.zeros_like(input_ids)
        loss_mask[0, a] = 1
        return model._backbone_forward(hidden_states, input_ids, loss_mask, torch.zeros(1, a + size + 1, 64),
                                       torch.zeros_like(input_ids), max_anchors=1)[0]
    return block


def readers(method, native, tmp_path):
    """(layout, block forward, Markov bias) of every reader of `method` that runs on CPU."""
    out = {}
    if method == "dflash":
        zlab = export_run(native, "zlab", tmp_path / "zlab")
        for module in ("dflash.model", "specforge.modeling.draft.dflash"):
            model = reference(module).DFlashDraftModel(Qwen3Config.from_pretrained(zlab)).eval()
            model.load_state_dict(load_file(str(zlab / "model.safetensors")))
            out[module] = (zlab_block(model), None)
    else:
        sf = export_run(native, "specforge", tmp_path / "sf")
        model = reference("specforge.modeling.draft.dspark").DSparkDraftModel(Qwen3Config.from_pretrained(sf)).eval()
        model.load_state_dict(load_file(str(sf / "model.safetensors")))
        out["specforge"] = (zlab_block(model), lambda prev, h, m=model: m.apply_logits_head(
            torch.zeros(1, 1, VOCAB), prev_token_ids=prev.view(1, 1), hidden_states=h.view(1, 1, -1))[0, 0][None])
    spec = reference_model(export_run(native, "speculators", tmp_path / "speculators"))
    bias = None if method == "dflash" else (lambda prev, h, m=spec: m.markov_head.block_bias(
        prev_token_ids=prev.view(1, 1), hidden_states=h.view(1, 1, -1))[0])
    out["speculators"] = (speculators_block(spec), bias)
    return out


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_every_reader_drafts_the_trained_drafter_as_our_decoder(method, target, trained, sequence, tmp_path):
    from draftsmith.eval.proposers import proposer_from_arg

    prompt, full = sequence
    ours = proposer_from_arg(f"{method}:{trained[method]}", target)
    drafts = ours.drafter.drafts_per_block
    decoded = SpeculativeDecoder(target, ours, num_draft=drafts, eos_token_id=()).generate(prompt, NEW_TOKENS)
    assert torch.equal(decoded.tokens, full[0, 10:])  # lossless
    stats = decoded.stats
    assert stats.per_position_acceptance[0] > 0 and stats.tau > 1.0, "the trained drafter accepts nothing"
    for layout, (block_fn, bias_fn) in readers(method, trained[method], tmp_path).items():
        proposer = (ReaderDFlash(ours.drafter, target, block_fn) if bias_fn is None
                    else ReaderDSpark(ours.drafter, target, block_fn, bias_fn))
        theirs = SpeculativeDecoder(target, proposer, num_draft=drafts, eos_token_id=()).generate(prompt, NEW_TOKENS)
        assert torch.equal(theirs.tokens, decoded.tokens)
        assert theirs.stats.per_position_acceptance[0] == stats.per_position_acceptance[0], layout
        assert theirs.stats.tau == stats.tau, layout
