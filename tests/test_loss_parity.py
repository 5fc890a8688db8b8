"""Loss parity with the reference trainers, on identical inputs (drafter weights, target
features, target logits, loss mask, anchors).

- DFlash: SpecForge's own `OnlineDFlashModel` (specforge 0.2.0,
  specforge/algorithms/common/dflash_family_model.py; github sgl-project/SpecForge @ a6b6b02)
  around SpecForge's `DFlashDraftModel` holding our weights.
- EAGLE-3: SpecForge's own `Eagle3TrainStrategy.forward_loss` (training/strategies/base.py,
  the 0.8**i sum) over `OnlineEagle3Model` (algorithms/eagle3/model.py, the TTT unroll,
  teacher and masks) around SpecForge's `LlamaForCausalLMEagle3` holding our weights; its
  LK losses (method.loss lk_lambda / lk_alpha) through the same model and through
  `_compute_loss_and_acceptance_rate` (core/lk_loss.py's functions) on random inputs.
- DSpark: DeepSpec (github deepseek-ai/DeepSpec @ afdfa7c) is not pip-installable; its
  loss is restated below from its source, formula by formula, with file and line. SpecForge's
  `OnlineDSparkModel` (same file as DFlash's) is run beside it.

Where ours departs from the reference on purpose, the test checks the exact stated
difference (EAGLE-3's loss-mask index and step normalisation; DeepSpec's 1e-6 in the
denominators), never a looser tolerance.

The specforge wheel is installed without its pinned dependencies (tests/test_parity.py);
without it these tests fail, naming the install command, never skip.
"""

import os
import sys
import types

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import LlamaConfig, Qwen3Config

from draftsmith.models.dflash_blocks import sample_anchors
from draftsmith.models.export import export_run
from draftsmith.models.native import save_drafter
from reference_impls import load_reference, reference
from tiny_models import MASK, VOCAB, dflash, dspark, eagle3

RTOL = 1e-5  # float32 throughout; relative, with no absolute slack


def loss_inputs(feature_width: int, seq: int = 24, seed: int = 0):
    """Two rows of random target features and tokens. Row 0's loss mask has a gap (12, 13:
    a turn the drafter does not learn) inside blocks; row 1 has fewer valid anchors than
    row 0, so its anchor list is padded."""
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(2, seq, feature_width, generator=g)
    ids = torch.randint(0, MASK, (2, seq), generator=g)
    loss_mask = torch.ones(2, seq)
    loss_mask[0, :4] = 0
    loss_mask[0, 12:14] = 0
    loss_mask[1, :10] = 0
    return feats, ids, loss_mask


# Anchors valid under both rules (loss_mask at a and a + 1). Row 0: 9 and 10 open blocks
# that cross the gap, 22 one that runs off the end; row 1 is padded with -1.
ANCHORS = torch.tensor([[4, 9, 10, 17, 22], [10, 15, 20, -1, -1]])


def keep_and_zero(anchors):
    """Our anchors (-1 pads) in the references' form: (anchors with pads at 0, keep mask)."""
    keep = anchors >= 0
    return anchors.clamp_min(0), keep


# ---------------------------------------------------------------- DFlash vs SpecForge

def specforge_trainer(drafter, target, tmp_path, dspark=False, **options):
    """SpecForge's OnlineDFlashModel (or OnlineDSparkModel) around its DFlashDraftModel (or
    DSparkDraftModel) loaded with our weights, set as ours is."""
    family = reference("specforge.algorithms.common.dflash_family_model")
    layout, draft_cls = ("specforge", reference("specforge.modeling.draft.dspark").DSparkDraftModel) if dspark \
        else ("zlab", family.DFlashDraftModel)
    out = export_run(save_drafter(drafter, tmp_path / "native"), layout, tmp_path / layout)
    config = Qwen3Config.from_pretrained(out)
    # Eager attention: their dense-mask path on CPU. It keeps the fully masked rows of padded
    # blocks finite (SDPA would give NaN there, and NaN * weight 0 is NaN); flex, their
    # default, is a CUDA kernel.
    config._attn_implementation = "eager"
    model = load_reference(draft_cls, out, config)
    c = drafter.config
    common = dict(draft_model=model, target_lm_head=target.get_output_embeddings(),
                  target_embed_tokens=target.get_input_embeddings(), mask_token_id=MASK, block_size=c.block_size,
                  attention_backend="sdpa", num_anchors=c.num_anchors, loss_decay_gamma=c.gamma,
                  objective_chunk_blocks=0)
    if dspark:
        trainer = family.OnlineDSparkModel(**common, dspark_ce_loss_alpha=c.ce_weight,
                                           dspark_l1_loss_alpha=c.tv_weight, dspark_confidence_head_alpha=c.bce_weight)
    else:
        trainer = family.OnlineDFlashModel(**common, **options)
    # Their anchors are drawn inside forward from the global RNG; the same anchors go in here.
    trainer._sample_anchor_positions = lambda seq_len, loss_mask, device: keep_and_zero(ANCHORS)
    return trainer


def assert_same_grads(ours: torch.nn.Module, theirs: torch.nn.Module):
    theirs_params = dict(theirs.named_parameters())
    for name, param in ours.named_parameters():
        if param.requires_grad:
            torch.testing.assert_close(param.grad, theirs_params[name].grad, rtol=RTOL, atol=1e-7, msg=name)


def test_dflash_loss_equals_specforge_online_dflash_model(target, tmp_path):
    """Blocks 9 and 10 of row 0 cross the loss-mask gap: SpecForge weights every loss-masked
    draft inside the sequence (dflash_family_model.py:418-432, no prefix rule), so the
    drafts after the gap count; block 22 runs off the end, row 1 has padded blocks."""
    drafter = dflash(target).train()
    trainer = specforge_trainer(drafter, target, tmp_path)
    feats, ids, loss_mask = loss_inputs(len(drafter.config.target_layer_ids) * target.config.hidden_size)
    theirs, _, _ = trainer(input_ids=ids, hidden_states=feats, loss_mask=loss_mask)
    ours, _ = drafter.loss(feats, ids, loss_mask, target.get_input_embeddings(),
                           target.get_output_embeddings(), anchors=ANCHORS)
    torch.testing.assert_close(ours, theirs, rtol=RTOL, atol=0)
    # The same function of the weights, not only the same value.
    ours.backward()
    theirs.backward()
    assert_same_grads(drafter, trainer.draft_model)


def test_dpace_weights_and_reduction_are_speculators(tmp_path):
    """D-PACE (method.position_weights=dpace) on identical per-draft CE and masks: our weights
    are speculators 0.9.0's `dpace_loss_decay` and our loss its `loss_function` (the masked,
    weighted sum over the supervised drafts), imported from its wheel."""
    from functools import partial

    from speculators.losses import dpace_loss_decay
    from speculators.losses.eager import ce_loss
    from speculators.losses.utils import loss_function

    from draftsmith.models.dflash_loss import dpace_weights, draft_reduction

    anchors, block, vocab = 6, 5, 50
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, anchors * block, vocab, generator=gen)
    labels = torch.randint(0, vocab, (1, anchors * block), generator=gen)
    mask = (torch.rand(1, anchors * block, generator=gen) > 0.25).float()
    mask[0, -block:] = 0  # a block with nothing supervised
    targets = F.one_hot(labels, vocab).float() * 20  # speculators' ce_loss takes the argmax as label
    decay = partial(dpace_loss_decay, loss_mask=mask, block_size=block, dpace_alpha=0.5)
    theirs = loss_function(logits, targets, mask, torch.arange(anchors * block)[None] % block, loss_fn=ce_loss,
                           decay_fn=decay)
    ce = F.cross_entropy(logits[0], labels[0], reduction="none").view(anchors, block)
    m = mask.view(anchors, block)
    their_weights = dpace_loss_decay(None, mask, block, 0.5, elementwise_loss=(ce * m).view(1, -1))
    torch.testing.assert_close(m * dpace_weights(ce, m, 0.5), their_weights.view(anchors, block), rtol=RTOL, atol=0)
    config = types.SimpleNamespace(position_weights="dpace", dpace_alpha=0.5)
    torch.testing.assert_close(draft_reduction(config, ce, m)(ce), theirs, rtol=RTOL, atol=1e-7)


def test_dflash_dpace_loss_is_specforges_over_the_drafts_not_the_batch(target, tmp_path):
    """SpecForge 0.2.0's OnlineDFlashModel with loss_type dpace weights each draft as ours does
    (its `_dpace_weight`) but divides the sum by the batch size, where speculators and ours
    divide by the drafts supervised: the same loss and gradients up to that one factor."""
    drafter = dflash(target).train()
    drafter.config.position_weights = "dpace"
    trainer = specforge_trainer(drafter, target, tmp_path, loss_type="dpace", dpace_alpha=drafter.config.dpace_alpha)
    feats, ids, loss_mask = loss_inputs(len(drafter.config.target_layer_ids) * target.config.hidden_size)
    theirs, _, _ = trainer(input_ids=ids, hidden_states=feats, loss_mask=loss_mask)
    ours, _ = drafter.loss(feats, ids, loss_mask, target.get_input_embeddings(),
                           target.get_output_embeddings(), anchors=ANCHORS)
    blocks = drafter.sample_blocks(ids, loss_mask, None, ANCHORS)
    supervised = float(blocks.in_data.sum())
    rescaled = theirs * ids.shape[0] / supervised
    torch.testing.assert_close(ours, rescaled, rtol=RTOL, atol=0)
    ours.backward()
    rescaled.backward()
    assert_same_grads(drafter, trainer.draft_model)


def test_dflash_anchor_rule_is_specforges():
    """With room for every anchor, both samplers return exactly the valid positions."""
    family = reference("specforge.algorithms.common.dflash_family_model")
    _, _, loss_mask = loss_inputs(8)
    sampler = family.OnlineDFlashModel._sample_anchor_positions
    theirs, keep = sampler(types.SimpleNamespace(num_anchors=64), loss_mask.shape[1], loss_mask, loss_mask.device)
    ours = sample_anchors(loss_mask, 64, torch.Generator().manual_seed(0))
    assert torch.equal(ours, torch.where(keep, theirs, -1))
    assert int(keep.sum()) == 7 + 9 + 13  # row 0: 4..10 and 14..22; row 1: 10..22


# ---------------------------------------------------------------- EAGLE-3 vs SpecForge

def import_without_triton(module: str):
    """SpecForge's EAGLE-3 trainer imports specforge/core/loss.py, whose fused loss is a
    Triton (GPU) kernel and which imports triton at the top; torch's CPU wheel has no
    triton. A stand-in with the two names that file touches at import (`triton.jit`,
    `triton.language.constexpr`) lets the module import; the kernel itself is never run
    (see `cpu_log_softmax_loss`). The stand-in leaves sys.modules right after the import."""
    try:
        import triton  # noqa: F401
        return reference(module)
    except ImportError:
        pass
    before = set(os.environ)
    torch.compile(lambda x: x)  # torch's own optional-triton probes run first, against the real absence
    for key in set(os.environ) - before:  # torch.compile exports its cache folder; leave the environment as found
        del os.environ[key]
    stub, language = types.ModuleType("triton"), types.ModuleType("triton.language")
    stub.jit, language.constexpr, stub.language = (lambda fn: fn), object, language
    sys.modules.update({"triton": stub, "triton.language": language})
    try:
        return reference(module)
    finally:
        del sys.modules["triton"], sys.modules["triton.language"]


class cpu_log_softmax_loss:
    """`LogSoftmaxLoss.apply` with SpecForge's own reference computation of the same loss,
    `_compute_loss` in the same file (core/loss.py:16, -sum(mask * p * log q).mean()); the
    fused kernel needs a GPU."""

    @staticmethod
    def apply(logits, target_p, position_mask):
        return sys.modules["specforge.core.loss"]._compute_loss(logits, target_p, position_mask)


@pytest.fixture
def specforge_eagle3(monkeypatch):
    model = import_without_triton("specforge.algorithms.eagle3.model")
    strategies = reference("specforge.training.strategies.base")
    monkeypatch.setattr(model, "LogSoftmaxLoss", cpu_log_softmax_loss)
    # Their teacher and loss are torch.compile'd; eager on CPU computes the same. Through
    # torch's own patch: pytest's monkeypatch (9.2) undoes a module attribute by deleting it,
    # which hides the config key from every later torch.compile in the session.
    with torch._dynamo.config.patch(disable=True):
        yield model, strategies


def specforge_eagle3_loss(specforge_eagle3, drafter, target, tmp_path, feats, ids, logits, loss_mask, attention,
                          adapter=None, **options):
    """(total, per-step losses with their graphs, its strategy's metrics, SpecForge's draft model)
    from SpecForge's strategy and model, given
    SpecForge's inputs: input_ids and target logits shifted left by one (what its
    TargetHead.preprocess and online capture hand the model) and its loss mask [B, T, 1].
    `options` go to OnlineEagle3Model (lk_loss_type, kl_scale, kl_decay); `adapter`, a
    backend adapter class, replaces its SDPA one."""
    model, strategies = specforge_eagle3
    draft_module = reference("specforge.modeling.draft.llama3_eagle")
    utils = reference("specforge.utils")
    contracts = reference("specforge.runtime.contracts")
    out = export_run(save_drafter(drafter, tmp_path / "native"), "sglang", tmp_path / "sglang")
    draft = draft_module.LlamaForCausalLMEagle3(LlamaConfig.from_pretrained(out), attention_backend="sdpa")
    state = load_file(str(out / "model.safetensors"))
    state["embed_tokens.weight"] = target.get_input_embeddings().weight.detach()
    draft.load_state_dict(state, strict=True)
    online = Recording(model.OnlineEagle3Model(draft, length=drafter.config.ttt_length, attention_backend="sdpa",
                                               **options))
    if adapter is not None:
        online.model._make_adapter = lambda: adapter(online.model)
    strategy = strategies.Eagle3TrainStrategy(online, ploss_decay=drafter.config.ttt_decay)
    batch = contracts.TrainBatch(sample_ids=["a", "b"], strategy="eagle3", tensors={
        "input_ids": utils.padding(ids, left=False), "target": utils.padding(logits, left=False),
        "loss_mask": loss_mask[..., None], "hidden_state": feats, "attention_mask": attention,
    })
    result = strategy.forward_loss(batch)
    return result.loss, online.outputs[0], result.metrics, draft


class Recording(torch.nn.Module):
    """The strategy's model, keeping what it returned: the step losses, with their graphs."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, **inputs):
        self.outputs = self.model(**inputs)
        return self.outputs


def eagle3_inputs(target, drafter, seq=16):
    g = torch.Generator().manual_seed(4)
    feats = torch.randn(2, seq, 3 * target.config.hidden_size, generator=g)
    ids = torch.randint(0, MASK, (2, seq), generator=g)
    logits = 3 * torch.randn(2, seq, VOCAB, generator=g)  # argmax outside the draft vocabulary at ~1 in 4
    loss_mask = torch.ones(2, seq)
    loss_mask[0, :5] = 0
    loss_mask[1, :3] = 0
    attention = torch.ones(2, seq, dtype=torch.long)
    attention[1, -3:] = 0  # row 1 right-padded
    loss_mask[1, -3:] = 0
    with torch.no_grad():  # at every other index the target agrees with the first draft: accuracies are not 0
        first = drafter.draft_to_target[drafter.ttt_logits(feats, ids, attention)[0].argmax(-1)]
    logits[:, 1::2].scatter_add_(-1, first[:, :-1:2, None], torch.full((2, seq // 2, 1), 20.0))
    return feats, ids, logits, loss_mask, attention


def shift_left(mask, by):
    return torch.cat([mask[:, by:], torch.zeros_like(mask[:, :by])], dim=1)


def trained_counts(drafter, logits, loss_mask, attention):
    """Per TTT step i, how many indices t train: label x_{t+2+i} loss-masked and real, and
    the target's argmax at t + 1 + i in the draft vocabulary."""
    learn = loss_mask.bool() & attention.bool()
    reachable = drafter.t2d[logits.argmax(-1)]
    length = learn.shape[1]
    return torch.tensor([float((learn[:, 2 + i:] & reachable[:, 1 + i:length - 1]).sum())
                         for i in range(drafter.config.ttt_length)])


def test_eagle3_loss_equals_specforge_strategy(specforge_eagle3, target, tmp_path):
    """Same TTT forward, teacher, draft-vocabulary mask and 0.8**i sum; two stated differences.

    1. The loss-mask index. SpecForge gates drafter index t, step i (label x_{t+2+i}) by
       loss_mask[t + i] (algorithms/eagle3/model.py:493 and :432, the mask left unshifted
       by modeling/target/target_head.py:107); ours by the label's own loss_mask[t + 2 + i]
       (docs/internals.md: masks apply to the predicted token). Theirs trains the two
       tokens after each assistant span, never drafted, and skips its first two, which
       are; we keep ours. SpecForge is given our mask shifted left by two.
    2. The step normalisation. SpecForge's step loss is a mean over all B * T indices
       (core/loss.py:16-21, `_compute_loss`, the kernel's reference); ours divides by the
       n_i indices that train, so that padding a batch wider does not rescale it (see
       Eagle3Drafter.loss). So theirs_i = ours_i * n_i / (B * T), exactly.
    """
    drafter = eagle3(target).train()
    feats, ids, logits, loss_mask, attention = eagle3_inputs(target, drafter)
    theirs, plosses, their_metrics, draft = specforge_eagle3_loss(specforge_eagle3, drafter, target, tmp_path, feats,
                                                                  ids, logits, shift_left(loss_mask, 2), attention)
    ours, metrics = drafter.loss(feats, ids, logits, loss_mask, attention)
    k, decay = drafter.config.ttt_length, drafter.config.ttt_decay
    counts, indices = trained_counts(drafter, logits, loss_mask, attention), ids.numel()
    assert 0 < counts.min() and counts.max() < indices  # the two normalisations differ at every step
    ours_steps = torch.tensor([metrics[f"loss_{j + 1}"] for j in range(k)])
    torch.testing.assert_close(ours_steps * counts / indices, torch.stack(plosses).detach(), rtol=RTOL, atol=0)
    torch.testing.assert_close(torch.tensor([metrics[f"acc_{j + 1}"] for j in range(k)]),
                               torch.stack(their_metrics["acces"]).float(), rtol=RTOL, atol=0)
    assert metrics["acc_1"] > 0.3
    # Their step losses renormalised by n_i are our loss, as a function of the weights too.
    renormalised = sum(decay**i * step * indices / counts[i] for i, step in enumerate(plosses))
    torch.testing.assert_close(ours, renormalised, rtol=RTOL, atol=0)
    ours.backward()
    renormalised.backward()
    assert_same_grads(drafter, draft)
    # Their strategy's loss is the 0.8**i sum of those same step losses.
    expected = sum(decay**i * float(step.detach()) for i, step in enumerate(plosses))
    assert float(theirs.detach()) == pytest.approx(expected, rel=RTOL, abs=0)
    # The mask shift is load-bearing: unshifted, SpecForge trains other indices.
    unshifted, *_ = specforge_eagle3_loss(specforge_eagle3, drafter, target, tmp_path, feats, ids, logits,
                                          loss_mask, attention)
    assert abs(float(unshifted.detach()) - float(theirs.detach())) > 1e-3


LK_CASES = [("lk_alpha", 1.0, 1.0), ("lk_lambda", 1.0, 1.0), ("lk_lambda", 0.6, 3.0)]
LK_TYPE = {"lk_alpha": "alpha", "lk_lambda": "lambda"}


@pytest.mark.parametrize("loss,kl_scale,kl_decay", LK_CASES)
def test_eagle3_lk_step_loss_equals_specforges(specforge_eagle3, loss, kl_scale, kl_decay):
    """One TTT step's LK loss (`ttt_step_loss`) against SpecForge 0.2.0's
    `_compute_loss_and_acceptance_rate` (algorithms/eagle3/model.py, which calls
    core/lk_loss.py's compute_acceptance_rate and compute_lk_loss) on identical random
    draft logits, target distributions (renormalised over the draft vocabulary, and the
    target's own probabilities of the draft tokens) and position mask: the same value,
    acceptance and gradient. The one stated difference, as for cross-entropy: SpecForge's
    soft cross-entropy (its `kl_loss`, which lk_lambda weights) is a mean over all B * T
    positions, ours over the n that train; SpecForge's is handed to LK rescaled by
    B * T / n through its own `reduce_loss_fn` hook. lk_alpha has no such term."""
    from draftsmith.models.eagle3 import ttt_step_loss

    model, _ = specforge_eagle3
    batch, length, vocab, draft_vocab = 2, 9, 48, 32
    g = torch.Generator().manual_seed(11)
    target_logits = 3 * torch.randn(batch, length, vocab, generator=g)
    ids = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
    target_p = target_logits[..., ids].softmax(-1)
    target_p_on_draft = target_logits.softmax(-1)[..., ids]
    trained = torch.rand(batch, length, generator=g) > 0.3
    trained[1, -3:] = False  # a padded tail
    logits = torch.randn(batch, length, draft_vocab, generator=g, requires_grad=True)
    theirs_logits = logits.detach().clone().requires_grad_(True)
    config = types.SimpleNamespace(loss=loss, kl_scale=kl_scale, kl_decay=kl_decay)
    ours, accept = ttt_step_loss(config, logits, target_p, trained, target_p_on_draft)
    scale = batch * length / float(trained.sum())
    assert scale > 1  # the two cross-entropy normalisations differ
    theirs_accept, theirs = model._compute_loss_and_acceptance_rate(
        logits=theirs_logits, target_p=target_p, target_p_on_draft=target_p_on_draft,
        position_mask=trained[..., None].int(), lk_loss_type=LK_TYPE[loss], kl_scale=kl_scale, kl_decay=kl_decay,
        reduce_loss_fn=lambda kl: kl * scale)
    torch.testing.assert_close(ours, theirs, rtol=RTOL, atol=0)
    torch.testing.assert_close(accept, theirs_accept, rtol=RTOL, atol=0)
    ours.backward()
    theirs.backward()
    torch.testing.assert_close(logits.grad, theirs_logits.grad, rtol=RTOL, atol=1e-8)
    assert float(logits.grad[~trained].abs().max()) == 0.0  # positions that do not train get no gradient


@pytest.mark.parametrize("loss,kl_scale,kl_decay", [LK_CASES[0], LK_CASES[2]])
def test_eagle3_lk_loss_equals_specforge_strategy(specforge_eagle3, target, tmp_path, loss, kl_scale, kl_decay):
    """method.loss lk_alpha / lk_lambda through the whole TTT unroll against SpecForge's
    OnlineEagle3Model(lk_loss_type=...) under its strategy's 0.8**i sum, on the inputs of
    test_eagle3_loss_equals_specforge_strategy and with its mask shift: every step loss,
    step acceptance (SpecForge's acceptance_rates, our accept_k), the total and the
    gradients agree. lk_lambda's cross-entropy term has the normalisation difference stated
    there; its per-step factor B * T / n_i is applied through SpecForge's adapter hook
    (`reduce_loss`, which it calls on that term alone)."""
    drafter = eagle3(target).train()
    drafter.config.loss, drafter.config.kl_scale, drafter.config.kl_decay = loss, kl_scale, kl_decay
    feats, ids, logits, loss_mask, attention = eagle3_inputs(target, drafter)
    counts, indices = trained_counts(drafter, logits, loss_mask, attention), ids.numel()
    scales = iter((indices / counts).tolist())  # lk_alpha computes the term too, and drops it
    adapters = reference("specforge.core.eagle3_adapters")

    class PerTrainedPosition(adapters.SdpaLikeAdapter):
        def reduce_loss(self, kl):
            return kl * next(scales)

    theirs, plosses, their_metrics, draft = specforge_eagle3_loss(
        specforge_eagle3, drafter, target, tmp_path, feats, ids, logits, shift_left(loss_mask, 2), attention,
        adapter=PerTrainedPosition, lk_loss_type=LK_TYPE[loss], kl_scale=kl_scale, kl_decay=kl_decay)
    assert next(scales, None) is None  # one rescaled term per step, in order
    ours, metrics = drafter.loss(feats, ids, logits, loss_mask, attention)
    k = drafter.config.ttt_length
    torch.testing.assert_close(torch.tensor([metrics[f"loss_{j + 1}"] for j in range(k)]),
                               torch.stack(plosses).detach(), rtol=RTOL, atol=0)
    torch.testing.assert_close(torch.tensor([metrics[f"accept_{j + 1}"] for j in range(k)]),
                               torch.stack(their_metrics["acceptance_rates"]), rtol=RTOL, atol=0)
    assert 0.01 < metrics["accept_1"] < 0.99  # neither vacuous nor saturated
    torch.testing.assert_close(ours, theirs, rtol=RTOL, atol=0)
    ours.backward()
    theirs.backward()
    assert_same_grads(drafter, draft)


# ---------------------------------------------------------------- DSpark vs DeepSpec's formulas

DEEPSPEC = "deepseek-ai/DeepSpec @ afdfa7c"


def deepspec_dspark_loss(drafter, hidden, ids, loss_mask, target_logits, anchors, head):
    """DeepSpec's DSpark training loss as its source states it (DEEPSPEC), from the
    backbone's block hidden states [B, N, block, H] (whose forward parity with SpecForge's
    DSparkDraftModel is tests/test_parity.py). Returns (loss, ce, l1, bce, den, tau_prob)."""
    cfg = drafter.config
    seq, size = ids.shape[1], cfg.block_size
    anchors, keep = keep_and_zero(anchors)
    # deepspec/modeling/dspark/qwen3/modeling.py:432-446: slot k's label is the token at a + k + 1.
    label_indices = anchors[..., None] + torch.arange(1, size + 1)
    safe = torch.where(keep[..., None], label_indices.clamp(max=seq - 1), torch.zeros_like(label_indices))
    expand = lambda t: t[:, None].expand(-1, anchors.shape[1], *t.shape[1:])  # noqa: E731
    target_ids = torch.gather(expand(ids), 2, safe)
    # modeling.py:447-465: the target's distribution for it is read at label index - 1.
    rows = (safe - 1).clamp(min=0)
    aligned = torch.gather(expand(target_logits), 2, rows[..., None].expand(-1, -1, -1, target_logits.shape[-1]))
    # common.py:172-188 (build_eval_mask): inside the sequence, loss-masked, a kept block, as a prefix.
    eval_mask = (label_indices < seq) & (torch.gather(expand(loss_mask), 2, safe) > 0.5) & keep[..., None]
    eval_mask = eval_mask.int().cumprod(-1).bool()
    # modeling.py:473-493: prev = [anchor token, labels 0..B-2]; logits + W2(W1[prev]).
    prev = torch.cat([torch.gather(ids, 1, anchors)[..., None], target_ids[..., :-1]], dim=-1)
    w1, w2 = drafter.markov_head.markov_w1, drafter.markov_head.markov_w2
    draft_logits = head(hidden) + w2(w1(prev))
    # modeling.py:504-514: confidence_head(concat(h, W1[prev])).
    confidence = drafter.confidence_head.proj(torch.cat([hidden, w1(prev)], dim=-1)).squeeze(-1).float()
    # loss.py:25-37: weights eval_mask * exp(-k / gamma), k = 0..B-1.
    weights = eval_mask.float() * torch.exp(-torch.arange(size).float() / cfg.gamma)
    den = weights.sum()
    # loss.py:109-114: CE; loss.py:82-86: L1 = sum |softmax(draft) - softmax(target)|.
    ce = F.cross_entropy(draft_logits.reshape(-1, draft_logits.shape[-1]), target_ids.reshape(-1), reduction="none")
    l1 = (draft_logits.float().softmax(-1) - aligned.float().softmax(-1)).abs().sum(-1)
    # loss.py:60-70 and 156-163: BCE against the detached clamp(1 - L1/2, 0, 1).
    accept = (1.0 - 0.5 * l1).clamp(0.0, 1.0)
    bce = F.binary_cross_entropy_with_logits(confidence, accept.detach(), reduction="none")
    # loss.py:237-252: each term num / (den + 1e-6), then 0.1 CE + 0.9 L1 + 1.0 BCE (world size 1).
    terms = [(t.reshape(weights.shape) * weights).sum() / (den + 1e-6) for t in (ce, l1, bce)]
    loss = cfg.ce_weight * terms[0] + cfg.tv_weight * terms[1] + cfg.bce_weight * terms[2]
    # loss.py:52-56, 135-139: tau_probabilistic over kept blocks with a supervised draft.
    valid = keep & eval_mask.any(-1)
    tau = ((accept * eval_mask).cumprod(-1).sum(-1) + 1.0)[valid].mean()
    return loss, *terms, den, tau


def test_dspark_loss_equals_specforge_online_dspark_model(target, tmp_path):
    """SpecForge's DSpark trainer (the same formulas as DeepSpec's below, each term over its
    weight sum without DeepSpec's + 1e-6) on the same inputs; target logits from its final
    hidden states through the target's head, as SpecForge computes them."""
    drafter = dspark(target, block_size=5).train()
    trainer = specforge_trainer(drafter, target, tmp_path, dspark=True)
    feats, ids, loss_mask = loss_inputs(len(drafter.config.target_layer_ids) * target.config.hidden_size)
    last = torch.randn(*ids.shape, target.config.hidden_size, generator=torch.Generator().manual_seed(8))
    head = target.get_output_embeddings()
    theirs, _, theirs_metrics = trainer(input_ids=ids, hidden_states=feats, loss_mask=loss_mask,
                                        target_last_hidden_states=last)
    ours, metrics = drafter.loss(feats, ids, loss_mask, target.get_input_embeddings(), head, head(last), anchors=ANCHORS)
    torch.testing.assert_close(ours, theirs, rtol=RTOL, atol=0)
    # Per-position CE as SpecForge logs it: the plain mean over supervised blocks.
    num, den = theirs_metrics["ratio_metrics"]["ce_position"]
    torch.testing.assert_close(torch.tensor([metrics[f"ce_{k + 1}"] for k in range(drafter.drafts_per_block)]),
                               num / den, rtol=RTOL, atol=0)
    ours.backward()
    theirs.backward()
    assert_same_grads(drafter, trainer.draft_model)


def test_dspark_loss_equals_deepspecs_formulas(target):
    drafter = dspark(target, block_size=5).train()
    assert (drafter.config.ce_weight, drafter.config.tv_weight, drafter.config.bce_weight) == (0.1, 0.9, 1.0)
    feats, ids, loss_mask = loss_inputs(len(drafter.config.target_layer_ids) * target.config.hidden_size)
    target_logits = 2 * torch.randn(*ids.shape, VOCAB, generator=torch.Generator().manual_seed(7))
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    ours, metrics = drafter.loss(feats, ids, loss_mask, embed, head, target_logits, anchors=ANCHORS)
    blocks = drafter.sample_blocks(ids, loss_mask, anchors=ANCHORS)
    hidden = drafter.training_hidden(feats, blocks, embed)
    theirs, ce, l1, bce, den, tau = deepspec_dspark_loss(drafter, hidden, ids, loss_mask, target_logits, ANCHORS, head)
    # The one stated difference: ours divides by max(den, 1e-6), DeepSpec by den + 1e-6.
    torch.testing.assert_close(ours, theirs * (den + 1e-6) / den, rtol=RTOL, atol=0)
    scale = float((den + 1e-6) / den)
    for name, value in (("ce", ce), ("tv", l1), ("bce", bce)):
        assert metrics[name] == pytest.approx(float(value) * scale, rel=RTOL, abs=0), name
    assert metrics["tau_prob"] == pytest.approx(float(tau), rel=RTOL, abs=0)
    ours.backward()
    grads = {name: p.grad.clone() for name, p in drafter.named_parameters() if p.grad is not None}
    drafter.zero_grad()
    (theirs * (den + 1e-6) / den).backward()
    for name, param in drafter.named_parameters():
        if name in grads:
            torch.testing.assert_close(grads[name], param.grad, rtol=RTOL, atol=1e-7, msg=name)
