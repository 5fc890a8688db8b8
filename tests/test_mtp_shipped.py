"""MTP modules that models ship (`method.init: from_target`): read from a DeepSeek-V3-style
checkpoint (`model.layers.{N + k}.*`, `num_nextn_predict_layers`) and a Qwen3-Next-style one
(`mtp.*`), tuned against the frozen target (`method.freeze_target`), and written back in
the layout they came in.

The checkpoints are tiny transformers models (DeepseekV3Config, Qwen3NextConfig) whose
safetensors get MTP tensors under the names and shapes those checkpoints use: a module's
decoder block under the target's own checkpoint names (per-expert MoE weights, as
save_pretrained writes the target's last layer), beside DeepSeek's enorm, hnorm, eh_proj,
shared_head.{norm,head}, embed_tokens, or Qwen3-Next's fc, pre_fc_norm_{embedding,hidden},
norm. What the heads draft is checked against an independent reading: transformers' own
MtpModel for DeepSeek-V3 (it loads the same files), and for Qwen3-Next (which transformers
gives no MTP class) the module the tensors were written from, built of transformers'
Qwen3-Next decoder layer and norms as vLLM's Qwen3NextMultiTokenPredictor composes them."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from chat_fixtures import tiny_chat_tokenizer
from draftsmith.cli import main
from draftsmith.errors import DraftsmithError
from draftsmith.models.export import export_run
from draftsmith.models.formats.mtp import load_from_target, read
from draftsmith.models.mtp import MTP_DIR, mtp_forward, mtp_losses
from draftsmith.models.native import load_drafter, save_drafter
from draftsmith.models.target import build_tiny_target, load_target, target_forward
from draftsmith.recipe import load_recipe
from draftsmith.train.mtp import HeadsOnFrozenTarget, MTPTraining, build_heads, depth_weights

H, N = 32, 2  # width and main layers of both tiny targets


def _fill(module: nn.Module, seed: int) -> None:
    """Every weight set (MoE experts are built uninitialised); norms around their identity."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            centre = 1.0 if name.endswith("norm.weight") and not _zero_centered(module) else 0.0
            p.copy_(torch.randn(p.shape, generator=g) * 0.1 + centre)


def _zero_centered(module: nn.Module) -> bool:
    return getattr(getattr(module, "config", None), "model_type", None) == "qwen3_next"


def _random(shape, g, norm: bool) -> torch.Tensor:
    return torch.randn(shape, generator=g) * 0.1 + (1.0 if norm else 0.0)


def deepseek_folder(folder: Path, vocab: int, depths: int = 2, mtp: bool = True) -> Path:
    """A tiny DeepSeek-V3 checkpoint with `depths` MTP modules stored as DeepSeek-V3 stores layer 61."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=vocab, hidden_size=H, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=N,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1, max_position_embeddings=128,
        num_nextn_predict_layers=depths)
    model = DeepseekV3ForCausalLM(config)
    _fill(model, seed=0)
    model.save_pretrained(folder)
    if mtp:
        stored = load_file(folder / "model.safetensors")
        g = torch.Generator().manual_seed(1)
        block = {n.removeprefix(f"model.layers.{N - 1}."): t.shape for n, t in stored.items()
                 if n.startswith(f"model.layers.{N - 1}.")}  # the last layer: an MoE layer, as layer 61 is
        for k in range(depths):
            own = {"enorm.weight": (H,), "hnorm.weight": (H,), "eh_proj.weight": (H, 2 * H),
                   "shared_head.norm.weight": (H,), **block}
            stored |= {f"model.layers.{N + k}.{n}": _random(s, g, n.endswith("norm.weight")) for n, s in own.items()}
            stored[f"model.layers.{N + k}.embed_tokens.weight"] = stored["model.embed_tokens.weight"].clone()
            stored[f"model.layers.{N + k}.shared_head.head.weight"] = stored["lm_head.weight"].clone()
        save_file(stored, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def qwen3_next_config(vocab: int):
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        vocab_size=vocab, hidden_size=H, intermediate_size=64, num_hidden_layers=N, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, full_attention_interval=2)  # layers: linear, full


class Qwen3NextMTP(nn.Module):
    """Qwen3-Next's MTP module as vLLM's Qwen3NextMultiTokenPredictor composes it (fc over
    [pre_fc_norm_embedding(embedding); pre_fc_norm_hidden(hidden)], one full-attention decoder
    layer, norm), of transformers' own Qwen3-Next classes; the state_dict keys are the
    checkpoint's under `mtp.` (experts aside, fused in memory)."""

    def __init__(self, config):
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer, Qwen3NextRMSNorm

        super().__init__()
        eps = config.rms_norm_eps
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.pre_fc_norm_embedding, self.pre_fc_norm_hidden = Qwen3NextRMSNorm(H, eps), Qwen3NextRMSNorm(H, eps)
        self.layers = nn.ModuleList([Qwen3NextDecoderLayer(config, layer_idx=config.layer_types.index("full_attention"))])
        self.norm = Qwen3NextRMSNorm(H, eps)

    def forward(self, embeds, hidden, rope):
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], -1))
        rows = x.shape[1]
        mask = torch.full((rows, rows), float("-inf")).triu(1)[None, None]
        return self.norm(self.layers[0](x, position_embeddings=rope, attention_mask=mask))


def checkpoint_names(state: dict) -> dict:
    """transformers' fused experts split back into the per-expert tensors checkpoints store."""
    out = {}
    for name, t in state.items():
        if name.endswith("experts.gate_up_proj"):
            gate, up = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                out[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = gate[e].clone()
                out[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = up[e].clone()
        elif name.endswith("experts.down_proj"):
            out |= {name.replace("down_proj", f"{e}.down_proj.weight"): t[e].clone() for e in range(t.shape[0])}
        else:
            out[name] = t.detach().clone()
    return out


def qwen3_next_folder(folder: Path, vocab: int, mtp: bool = True) -> tuple[Path, Qwen3NextMTP]:
    """A tiny Qwen3-Next checkpoint with its MTP module under mtp.*, and that module."""
    from transformers import Qwen3NextForCausalLM

    config = qwen3_next_config(vocab)
    model = Qwen3NextForCausalLM(config)
    _fill(model, seed=0)
    model.save_pretrained(folder)
    module = Qwen3NextMTP(config)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():  # zero-centred norms: weights around 0, as Qwen3-Next stores them
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    if mtp:
        stored = load_file(folder / "model.safetensors")
        stored |= {f"mtp.{n}": t for n, t in checkpoint_names(module.state_dict()).items()}
        save_file(stored, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder, module.eval()


def mtp_names(folder: Path, prefix: str) -> dict[str, tuple]:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {n: tuple(f.get_slice(n).get_shape()) for n in f.keys() if n.startswith(prefix)}


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_chat_tokenizer("qwen3")


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory, tokenizer):
    folder = deepseek_folder(tmp_path_factory.mktemp("deepseek"), len(tokenizer))
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    return qwen3_next_folder(tmp_path_factory.mktemp("qwen3-next"), 96)


def depth_logits(heads, target, ids):
    last = target.config.num_hidden_layers - 1
    with torch.no_grad():
        return mtp_forward(heads, target, ids, target_forward(target, ids, capture=[last]).hidden[last])


# ---------------------------------------------------------------- (a) the heads draft as the checkpoint says


def test_deepseek_heads_draft_as_transformers_reads_the_checkpoint(deepseek):
    """transformers' MtpModel loads the same files: its depth-k logits equal ours. It chains a
    depth's output after shared_head.norm to the next; vLLM's DeepSeekMTP and SGLang pass the
    block's output (our default `hidden`), so depth 2 is compared both ways."""
    from transformers.modeling_layers import MtpModel

    target = load_target(deepseek)
    heads = load_from_target(deepseek, target)
    assert heads.num_depths == 2 and heads.config.chain_input == "hidden"
    # transformers finds MTP layers by DeepSeek-V3's own index (61); point it at this tiny one's.
    target._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{N + k}\..*" for k in range(2)]
    ref = MtpModel.from_pretrained(target).eval()
    ids = torch.randint(0, target.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(3))
    ours = depth_logits(heads, target, ids)
    with torch.no_grad():
        h0 = target(ids, output_hidden_states=True).hidden_states[-1]  # the engines' input: after the final norm
        positions = [torch.arange(ids.shape[1] - k)[None] for k in (1, 2)]
        ref.layers[0].use_post_norm = False  # the block's output, as vLLM and SGLang chain it
        hidden = ref.forward_layer(0, h0[:, :-1], positions[0], None, input_ids=ids[:, 1:])
        ref.layers[0].use_post_norm = True
        normed = ref.forward_layer(0, h0[:, :-1], positions[0], None, input_ids=ids[:, 1:])
        torch.testing.assert_close(ours[0], ref._project_to_logits(normed))
        second = ref.forward_layer(1, hidden[:, :-1], positions[1], None, input_ids=ids[:, 2:])
        torch.testing.assert_close(ours[1], ref._project_to_logits(second))
        heads.config.chain_input = "normed"
        theirs = ref.forward_layer(1, normed[:, :-1], positions[1], None, input_ids=ids[:, 2:])
        torch.testing.assert_close(depth_logits(heads, target, ids)[1], ref._project_to_logits(theirs))


def test_qwen3_next_heads_draft_as_the_module_they_were_written_from(qwen3_next):
    folder, module = qwen3_next
    target = load_target(folder)
    heads = load_from_target(folder, target)
    assert heads.num_depths == 1 and heads.config.chain_input == "normed"  # vLLM chains its output after mtp.norm
    ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        h0 = target(ids, output_hidden_states=True).hidden_states[-1]
        rope = target.model.rotary_emb(h0, torch.arange(10)[None])
        out = module(target.get_input_embeddings()(ids[:, 1:]), h0[:, :-1], rope)
        ref = target.get_output_embeddings()(out)
    ours = depth_logits(heads, target, ids)[0]
    assert ref.abs().max() > 1  # the module's weights reach the logits
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(heads.layers[0].shared_head.norm(torch.ones(1, H)), module.norm(torch.ones(1, H)))


# ---------------------------------------------------------------- (b) tuning against the frozen target


def greedy_rows(target, rows: int, prompt: int, length: int, seed: int) -> torch.Tensor:
    """The target's own greedy continuations of random prompts (no cache: a handful of steps)."""
    ids = torch.randint(0, target.config.vocab_size, (rows, prompt), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        while ids.shape[1] < length:
            ids = torch.cat([ids, target(ids).logits[:, -1:].argmax(-1)], 1)
    return ids


def scores(heads, target, ids) -> tuple[list[float], list[float]]:
    """Per-depth loss and greedy accuracy (what a verify pass accepts); with prompts of 2, every
    label of depth k >= 1 (t_{i+k+1}) is a continuation token."""
    losses, accs = mtp_losses(depth_logits(heads, target, ids), ids)
    return [x.item() for x in losses], accs


def test_tuning_against_the_frozen_target_raises_accuracy_on_its_own_continuations(deepseek):
    target = load_target(deepseek, dtype="float32")
    heads = load_from_target(deepseek, target)
    heads.config.freeze_target = True
    frozen = {n: p.clone() for n, p in target.state_dict().items()}
    model = HeadsOnFrozenTarget(target, heads)
    assert not any(n.startswith("target") for n, _ in model.named_parameters())  # only the heads train
    train, held_out = greedy_rows(target, 64, 2, 16, seed=5), greedy_rows(target, 16, 2, 16, seed=6)
    before = scores(heads, target, held_out)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0)
    method = SimpleNamespace(config=heads.config)  # all MTPTraining.loss reads with freeze_target
    for step in range(30):
        loss, metrics = MTPTraining.loss(method, model, {"input_ids": train}, step)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert "loss_main" not in metrics and {"loss_mtp_1", "acc_mtp_2"} <= set(metrics)
    after = scores(heads, target, held_out)
    for k in range(2):  # both depths, on continuations the tuning never saw (chance: 1/330)
        assert after[0][k] < 0.9 * before[0][k], (before, after)
        assert after[1][k] > before[1][k] + 0.08, (before, after)
    assert all(torch.equal(p, frozen[n]) for n, p in target.state_dict().items())


def test_depth_weights_and_the_chain_the_heads_train_with(deepseek):
    # speculators' FastMTP step weights: 0.6**(k-1), normalised
    assert [round(w, 2) for w in depth_weights(3, 0.6)] == [0.51, 0.31, 0.18]
    target = load_target(deepseek)
    for keys, chain in (([], "hidden"), (["method.chain_input=normed"], "normed")):
        recipe = load_recipe(None, ["method.name=mtp", "method.init=from_target", f"target.path={deepseek}", *keys])
        assert build_heads(recipe, target).config.chain_input == chain  # the checkpoint's, unless the recipe says
    # new heads train with the recipe's chain too, not only decode with it
    recipe = load_recipe(None, ["method.name=mtp", "method.num_depths=3", "method.chain_input=normed"])
    heads = build_heads(recipe, target)
    assert heads.num_depths == 3 and heads.config.chain_input == "normed"


# ---------------------------------------------------------------- (c) a run, its export, and back


def run_recipe(folder: Path, tmp_path: Path, **method) -> tuple[int, Path]:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"Line {i}: the quick brown fox jumps over the lazy dog; two plus two is four."
                                for i in range(60)))
    out = tmp_path / "run"
    keys = {"target.path": folder, "data.dataset": corpus, "method.name": "mtp", "method.init": "from_target",
            "method.freeze_target": "true", "train.output_dir": out, "train.max_steps": 6, "train.batch_size": 4,
            "train.seq_len": 24, "train.lr": 1e-2, "train.log_every": 1, "train.validation_every": 6,
            "train.validation_batches": 1, "train.save_every": 6, "tracking.report_to": "none"}
    keys |= {f"method.{k}": v for k, v in method.items()}
    return main(["train", *(f"{k}={v}" for k, v in keys.items())]), out


def test_a_tuned_run_exports_where_the_checkpoint_had_its_modules_and_reads_back(deepseek, tmp_path):
    code, run = run_recipe(deepseek, tmp_path)
    assert code is None or code == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "train/loss_mtp_2" in r]
    assert trained and not any("train/loss_main" in r for r in rows)  # the heads alone
    assert trained[-1]["train/loss_mtp_1"] < trained[0]["train/loss_mtp_1"]
    config = json.loads((run / "model" / MTP_DIR / "config.json").read_text())["config"]
    assert config["num_depths"] == 2 and config["init"] == "from_target" and config["freeze_target"]
    original = load_target(deepseek)
    target = load_target(run / "model")
    assert all(torch.equal(p, original.state_dict()[n]) for n, p in target.state_dict().items())  # frozen
    tuned = load_drafter(run / "model" / MTP_DIR, "mtp", target)
    shipped = load_from_target(deepseek, target)
    assert not torch.equal(tuned.layers[1].eh_proj.weight, shipped.layers[1].eh_proj.weight)  # it moved
    out = export_run(run, "vllm", tmp_path / "export")
    # The names and shapes DeepSeek-V3 stores its modules under, nothing more, nothing less.
    assert mtp_names(out, f"model.layers.{N}") | mtp_names(out, f"model.layers.{N + 1}") == \
        mtp_names(deepseek, f"model.layers.{N}") | mtp_names(deepseek, f"model.layers.{N + 1}")
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 2
    back = read(out, target)
    for (name, a), b in zip(tuned.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a, b), name


def test_qwen3_next_modules_tuned_export_under_mtp_and_read_back(qwen3_next, tmp_path):
    from transformers import AutoModelForCausalLM

    folder, _ = qwen3_next
    target = load_target(folder, dtype="float32")
    heads = load_from_target(folder, target)
    heads.config.freeze_target = True
    model = HeadsOnFrozenTarget(target, heads)
    ids = greedy_rows(target, 8, 3, 16, seed=7)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        MTPTraining.loss(SimpleNamespace(config=heads.config), model, {"input_ids": ids}, step)[0].backward()
        optimizer.step()
        optimizer.zero_grad()
    run = tmp_path / "run"
    target.save_pretrained(run / "model")
    save_drafter(heads, run / "model" / MTP_DIR)
    out = export_run(run, "vllm", tmp_path / "export")
    assert mtp_names(out, "mtp.") == mtp_names(folder, "mtp.")  # Qwen3-Next's names and shapes
    config = json.loads((out / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1 and config["model_type"] == "qwen3_next"
    back = read(out, target)
    assert back.config.chain_input == "normed"
    for (name, a), b in zip(heads.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a, b), name
    reloaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)  # still the plain target
    assert not info["missing_keys"] and not info["mismatched_keys"]


# ---------------------------------------------------------------- (d) bad input: one line each


def one_line(call, match: str) -> str:
    with pytest.raises(DraftsmithError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message and match in message, message
    return message


def test_a_target_without_mtp_modules_is_one_line(tmp_path, qwen3_next):
    llama = tmp_path / "llama"
    build_tiny_target(vocab_size=96, num_layers=2, hidden_size=H, num_heads=4).save_pretrained(llama)
    one_line(lambda: load_from_target(llama, load_target(llama)), "ships no MTP modules draftsmith reads")
    # transformers writes num_nextn_predict_layers 1 into every DeepSeek-V3 config, weights or not
    bare = deepseek_folder(tmp_path / "deepseek", 96, depths=1, mtp=False)
    one_line(lambda: load_from_target(bare, load_target(bare)), "no MTP tensors are stored under model.layers.2.")
    bare, _ = qwen3_next_folder(tmp_path / "qwen3-next", 96, mtp=False)
    assert one_line(lambda: load_from_target(bare, load_target(bare)), "no mtp.* tensors").startswith(
        "method.init=from_target: ")


def test_bad_method_keys_are_one_line():
    one_line(lambda: load_recipe(None, ["method.name=mtp", "method.init=shipped"]),
             "method.init: one of new, from_target, got 'shipped'")
    recipe = load_recipe(None, ["method.name=mtp", "method.init=from_target"])
    one_line(lambda: MTPTraining(recipe, torch.device("cpu")), "method.init=from_target reads the MTP modules")


def test_a_recipe_num_depths_other_than_the_checkpoints_is_one_line(deepseek, tmp_path, capsys):
    code, run = run_recipe(deepseek, tmp_path, num_depths=3)
    err = capsys.readouterr().err
    assert code == 2 and err.count("draftsmith: error: ") == 1 and "Traceback" not in err
    line = err.split("draftsmith: error: ")[1].splitlines()[0]
    assert line.startswith("method.num_depths=3: target ") and "ships 2 MTP module(s)" in line
    assert not (run / "model").exists()
