"""The accelerator paths of drafter training (models/attention.py): flex attention gives what
the dense-mask path gives, gradient checkpointing changes nothing, and a missing flash-attn
is a one-line error. torch has no flex-attention backward on CPU, so here flex is checked
forward (against SDPA) and through its mask_mod (against the dense mask); the gradient
check of flex runs only where CUDA is."""

import importlib.util

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

from draftsmith.errors import DraftsmithError
from draftsmith.models.attention import use_flex
from draftsmith.models.dflash import DFlashConfig, DFlashDrafter, concat_layers
from draftsmith.models.dflash_blocks import block_mask_mod, block_visibility, make_blocks, sample_anchors
from draftsmith.models.dspark import DSparkConfig, DSparkDrafter
from draftsmith.models.eagle3 import Eagle3Drafter, ttt_mask_mod
from draftsmith.models.target import build_tiny_target, freeze, load_target, target_forward
from draftsmith.recipe import recipe_from_dict
from tiny_models import MASK, VOCAB  # conftest.py's `target` is tiny_models.tiny_target

CUDA = torch.cuda.is_available()


def block_drafter(target, cls="dflash", **overrides):
    config_cls, module_cls = (DSparkConfig, DSparkDrafter) if cls == "dspark" else (DFlashConfig, DFlashDrafter)
    extra = {"markov_rank": 8} if cls == "dspark" else {}
    config = config_cls.from_target(target.config, **{"mask_token_id": MASK, "num_layers": 2, "block_size": 5,
                                                     "num_anchors": 6, **extra, **overrides})
    drafter = module_cls(config)
    if cls == "dspark":
        with torch.no_grad():  # a refiner that does something
            drafter.markov_head.markov_w2.weight.normal_(std=0.5)
    return drafter


def block_batch(target, drafter, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, MASK, (2, 30), generator=gen).to(target.device)
    mask = torch.ones_like(ids)
    mask[:, :4] = 0
    mask[1, 9:] = 0  # 4 anchors in row 1: padding blocks
    out = target_forward(target, ids, capture=drafter.config.target_layer_ids)
    return concat_layers(out.hidden, drafter.config.target_layer_ids), ids, mask, out.logits


def block_loss(drafter, target, batch, seed=0):
    feats, ids, mask, logits = batch
    extra = (logits,) if isinstance(drafter, DSparkDrafter) else ()
    return drafter.loss(feats, ids, mask, target.get_input_embeddings(), target.get_output_embeddings(), *extra,
                        generator=torch.Generator().manual_seed(seed))


def eagle3_drafter(target, **overrides):
    torch.manual_seed(0)
    return Eagle3Drafter.from_target(target, draft_vocab_size=96, ttt_length=3, **overrides)


def eagle3_batch(target, drafter):
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1)).to(target.device)
    attention = torch.ones_like(ids)
    attention[1, :5] = 0  # left padding
    out = target_forward(target, ids, attention_mask=attention, capture=drafter.config.target_layer_ids)
    hidden = torch.cat([out.hidden[i] for i in drafter.config.target_layer_ids], dim=-1)
    loss_mask = torch.ones_like(ids)
    loss_mask[:, :6] = 0
    return hidden, ids, out.logits, loss_mask, attention


def grads(module):
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


# ---------------------------------------------------------------- configuration

def test_backend_is_a_config_field_checked_in_one_line(target):
    assert DFlashConfig.from_target(target.config, mask_token_id=MASK).attention_backend == "sdpa"
    assert eagle3_drafter(target).config.attention_backend == "sdpa"
    for build in (lambda: block_drafter(target, attention_backend="flash"),
                  lambda: eagle3_drafter(target, attention_backend="eager")):
        with pytest.raises(DraftsmithError, match="attention_backend .* is not one of sdpa, flex, auto") as err:
            build()
        assert "\n" not in str(err.value)
    method = recipe_from_dict({"method": {"name": "dspark", "attention_backend": "auto"}}).method
    assert method.params == {"attention_backend": "auto"}
    assert not use_flex("auto", torch.device("cpu")) and use_flex("flex", torch.device("cpu"))
    assert use_flex("auto", torch.device("cuda")) and not use_flex("sdpa", torch.device("cuda"))


def test_flash_attention_2_without_flash_attn_is_one_line(target, tmp_path, monkeypatch):
    target.save_pretrained(tmp_path / "t")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "flash_attn" else real(name, *a))
    with pytest.raises(DraftsmithError, match="flash_attention_2: flash-attn asked for but not installed") as err:
        load_target(tmp_path / "t", attn_implementation="flash_attention_2")
    assert "\n" not in str(err.value)
    assert load_target(tmp_path / "t", attn_implementation="sdpa").config.num_hidden_layers == 6


# ---------------------------------------------------------------- flex attention

def test_block_mask_mod_is_the_dense_training_mask():
    anchors = torch.tensor([[2, 4, 9], [0, 3, 0]])  # row 1: padding blocks sit at anchor 0
    context, size = 11, 3
    queries = anchors.shape[1] * size
    mask = create_mask(block_mask_mod(anchors, context, size), 2, 1, queries, context + queries, device="cpu")
    assert torch.equal(mask, block_visibility(anchors, context, size))


def test_ttt_mask_mod_is_attend_s_rule():
    length, steps = 7, 3
    real = torch.ones(2, length, dtype=torch.bool)
    real[1, :3] = False
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    eye = torch.eye(length, dtype=torch.bool)
    for r in (None, real):
        context = causal.expand(2, -1, -1) if r is None else causal & (r[:, None, :] | eye)
        expected = torch.cat([context, eye.expand(2, -1, -1).repeat(1, 1, steps - 1)], dim=-1)[:, None]
        mask = create_mask(ttt_mask_mod(length, r), 2, 1, length, steps * length, device="cpu")
        assert torch.equal(mask, expected)


@pytest.mark.parametrize("cls", ["dflash", "dspark"])
def test_flex_blocks_equal_sdpa_blocks(target, cls):
    drafter = block_drafter(target, cls).eval()
    batch = block_batch(target, drafter)
    feats, ids, mask, _ = batch
    blocks = make_blocks(ids, mask, sample_anchors(mask, 6, torch.Generator().manual_seed(0)), drafter.config)
    assert (blocks.label_mask.sum(-1) == 0).any()  # padding blocks are covered
    with torch.no_grad():
        dense = drafter.training_hidden(feats, blocks, target.get_input_embeddings())
        dense_loss, dense_metrics = block_loss(drafter, target, batch)
        drafter.config.attention_backend = "flex"
        flex = drafter.training_hidden(feats, blocks, target.get_input_embeddings())
        flex_loss, flex_metrics = block_loss(drafter, target, batch)
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(flex_loss, dense_loss, rtol=1e-5, atol=1e-6)
    assert flex_metrics.keys() == dense_metrics.keys()


def test_flex_ttt_equals_dense_ttt(target):
    drafter = eagle3_drafter(target).eval()
    hidden, ids, logits, loss_mask, attention = eagle3_batch(target, drafter)
    with torch.no_grad():
        dense = drafter.ttt_logits(hidden, ids, attention)
        dense_loss, _ = drafter.loss(hidden, ids, logits, loss_mask, attention)
        drafter.config.attention_backend = "flex"
        flex = drafter.ttt_logits(hidden, ids, attention)
        flex_loss, _ = drafter.loss(hidden, ids, logits, loss_mask, attention)
        unpadded = drafter.ttt_logits(hidden, ids)  # no attention mask: the causal rule alone
        drafter.config.attention_backend = "sdpa"
        torch.testing.assert_close(unpadded, drafter.ttt_logits(hidden, ids), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(flex_loss, dense_loss, rtol=1e-5, atol=1e-6)


def test_flex_training_on_cpu_is_a_one_line_error(target):
    drafter = block_drafter(target, attention_backend="flex").train()
    with pytest.raises(DraftsmithError, match="no flex-attention backward on CPU") as err:
        block_loss(drafter, target, block_batch(target, drafter))
    assert "\n" not in str(err.value)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="flex attention has a backward on CUDA only")
@pytest.mark.parametrize("cls", ["dflash", "dspark", "eagle3"])
def test_flex_gradients_equal_sdpa_gradients_on_cuda(cls):
    device = torch.device("cuda")
    gpu_target = freeze(build_tiny_target(seed=1, arch="qwen3", vocab_size=VOCAB, num_layers=6, hidden_size=64,
                                          num_heads=4, num_kv_heads=2)).to(device)
    results = []
    for backend in ("sdpa", "flex"):
        if cls == "eagle3":
            drafter = eagle3_drafter(gpu_target, attention_backend=backend).to(device).train()
            loss, _ = drafter.loss(*eagle3_batch(gpu_target, drafter))
        else:
            torch.manual_seed(0)
            drafter = block_drafter(gpu_target, cls, attention_backend=backend).to(device).train()
            loss, _ = block_loss(drafter, gpu_target, block_batch(gpu_target, drafter))
        loss.backward()
        results.append((loss.detach(), grads(drafter)))
    (dense_loss, dense_grads), (flex_loss, flex_grads) = results
    torch.testing.assert_close(flex_loss, dense_loss, rtol=1e-4, atol=1e-5)
    assert flex_grads.keys() == dense_grads.keys()
    for name in dense_grads:
        torch.testing.assert_close(flex_grads[name], dense_grads[name], rtol=1e-3, atol=1e-4, msg=name)


# ---------------------------------------------------------------- gradient checkpointing

def assert_checkpointing_changes_nothing(drafter, run_loss, min_grads: int) -> None:
    """Loss, metrics and every gradient bit-identical with checkpointing off and on."""
    results = []
    for enabled in (False, True):
        drafter.zero_grad(set_to_none=True)
        drafter.gradient_checkpointing = enabled
        loss, metrics = run_loss()
        loss.backward()
        results.append((loss.detach(), metrics, grads(drafter)))
    (plain, plain_metrics, plain_grads), (ckpt, ckpt_metrics, ckpt_grads) = results
    assert torch.equal(ckpt, plain) and ckpt_metrics == plain_metrics
    assert ckpt_grads.keys() == plain_grads.keys() and len(plain_grads) > min_grads
    assert all(torch.equal(ckpt_grads[n], plain_grads[n]) for n in plain_grads)


@pytest.mark.parametrize("cls", ["dflash", "dspark"])
def test_gradient_checkpointing_changes_nothing_in_block_drafters(target, cls):
    torch.manual_seed(0)
    drafter = block_drafter(target, cls).train()
    batch = block_batch(target, drafter)
    assert_checkpointing_changes_nothing(drafter, lambda: block_loss(drafter, target, batch), min_grads=20)


def test_gradient_checkpointing_changes_nothing_in_ttt(target):
    drafter = eagle3_drafter(target).train()
    batch = eagle3_batch(target, drafter)
    assert_checkpointing_changes_nothing(drafter, lambda: drafter.loss(*batch), min_grads=8)


def test_checkpointing_stores_fewer_activations(target):
    # The option takes effect: the layers' activations are recomputed, not kept for backward.
    def saved_numel(drafter, run):
        total = [0]

        def pack(t):
            total[0] += t.numel()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run(drafter)
        return total[0]

    runs = ((block_drafter(target).train(), lambda d: block_loss(d, target, block_batch(target, d))),
            (eagle3_drafter(target).train(), lambda d: d.loss(*eagle3_batch(target, d))))
    for drafter, run in runs:
        plain = saved_numel(drafter, run)
        drafter.gradient_checkpointing = True
        assert saved_numel(drafter, run) < 0.5 * plain


def test_recipe_switch_reaches_the_post_hoc_drafters(tmp_path):
    from draftsmith.train.loop import train
    from draftsmith.train.method import build_method
    from tiny_runs import tiny_recipe

    run = tmp_path / "target"
    train(tiny_recipe("mtp", run, target__num_layers=4, train__max_steps=1, train__validation_every=100,
                      train__save_every=100))
    small = dict(target__path=str(run), data__num_conversations=4, data__prompt_chars=60,
                 data__regen_max_new_tokens=8, train__seq_len=48, train__gradient_checkpointing=True)
    for name, extra in (("dflash", {}), ("dspark", {}), ("eagle3", {"method__draft_vocab_size": 256})):
        method = build_method(tiny_recipe(name, tmp_path / name, **small, **extra), torch.device("cpu"))
        assert method.model.drafter.gradient_checkpointing, name
