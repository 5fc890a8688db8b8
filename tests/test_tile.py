import json

import pytest

from draftsmith.errors import DraftsmithError
from draftsmith.models.tile import (
    fitting_tile,
    format_plan,
    plan_command,
    plan_tile,
    read_target_config,
    tree_budget,
)

# The attention fields of the published config.json files (other fields left out).
LLAMA_31_8B = {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8}
LLAMA_3_70B = {"model_type": "llama", "hidden_size": 8192, "num_attention_heads": 64, "num_key_value_heads": 8}
QWEN3_8B = {
    "model_type": "qwen3", "hidden_size": 4096, "head_dim": 128, "num_attention_heads": 32, "num_key_value_heads": 8,
}
QWEN25_7B = {"model_type": "qwen2", "hidden_size": 3584, "num_attention_heads": 28, "num_key_value_heads": 4}
MISTRAL_7B = {"model_type": "mistral", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8}
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,  # present in the file, but MLA caches one latent KV
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
}


@pytest.mark.parametrize(
    "config, tp, G, D",
    [
        (LLAMA_31_8B, 1, 4, 31),
        (QWEN3_8B, 1, 4, 31),
        (MISTRAL_7B, 1, 4, 31),
        (QWEN25_7B, 1, 7, 17),
        (LLAMA_3_70B, 1, 8, 15),
        (LLAMA_3_70B, 8, 8, 15),  # one KV head per rank, 8 query heads on it
        (DEEPSEEK_V3, 8, 16, 7),
        (DEEPSEEK_V3, 1, 128, 0),
    ],
)
def test_real_targets_at_tile_128(config, tp, G, D):
    plan = plan_tile(config, tile=128, tp=tp)
    assert (plan.G, plan.D) == (G, D)
    assert plan.G * (1 + plan.D) <= 128 < plan.G * (2 + plan.D)


def test_mla_counts_one_kv_head():
    plan = plan_tile(DEEPSEEK_V3, tp=8)
    assert (plan.H, plan.KV, plan.mla) == (128, 1, True)
    assert not plan_tile(LLAMA_31_8B).mla


def test_tp_beyond_kv_heads_replicates_them():
    # Llama-3.1-8B at tp 16: 2 query heads per rank share one replicated KV head.
    plan = plan_tile(LLAMA_31_8B, tp=16)
    assert (plan.G, plan.D) == (2, 63)


def test_no_room_names_the_tile_that_fits():
    text = format_plan(plan_tile(DEEPSEEK_V3, tp=1))
    assert "no room for drafts" in text
    assert "a tile of 256 rows would fit one draft" in text
    assert fitting_tile(65) == 192
    assert fitting_tile(200) == 400  # past the common sizes: 2G itself


def test_format_plan_explains_g_and_tabulates_around_d():
    text = format_plan(plan_tile(QWEN25_7B))
    assert "G is the group size (query heads per KV head)" in text
    assert "| 17 = D | 126 | 1 |" in text
    assert "| 18 | 133 | 2 |" in text
    assert "| 35 | 252 | 2 |" in text  # 2D + 1
    assert "tree of 18 nodes" in text
    assert "DFlash block_size auto = 16 (15 drafts), capped at 16" in text  # D = 17
    assert "DSpark block_size auto = 16 (16 drafts), capped at 16" in text


def test_format_plan_states_the_block_cap_only_when_it_applies():
    text = format_plan(plan_tile(LLAMA_3_70B))  # G = 8: D = 15, 1 + D = 16 fits the cap
    assert "DFlash block_size auto = 16 (15 drafts)\n" in text and "DSpark block_size auto = 15 (15 drafts)\n" in text
    assert "capped" not in text
    text = format_plan(plan_tile(QWEN3_8B))  # G = 4: D = 31
    assert "block_size auto = 16" in text and "capped at 16" in text and "set block_size and gamma" in text


def test_tree_budget_counts_the_root():
    assert tree_budget(plan_tile(LLAMA_31_8B)) == 32
    assert tree_budget(plan_tile(QWEN25_7B)) == 18
    assert tree_budget(plan_tile(DEEPSEEK_V3)) == 1  # the root alone overflows nothing more


def test_mha_and_smaller_tiles():
    mha = {"num_attention_heads": 16}  # no num_key_value_heads: one KV head per query head
    assert (plan_tile(mha).KV, plan_tile(mha).G, plan_tile(mha).D) == (16, 1, 127)
    assert plan_tile(LLAMA_31_8B, tile=64).D == 15  # FlashMLA-sized tile


def test_multi_query():
    starcoder = {"model_type": "gpt_bigcode", "n_head": 48, "multi_query": True}
    plan = plan_tile(starcoder)
    assert (plan.H, plan.KV, plan.G, plan.D) == (48, 1, 48, 1)


def test_heads_not_divisible_by_kv_names_both():
    with pytest.raises(DraftsmithError, match=r"num_attention_heads 30 .* num_key_value_heads 8"):
        plan_tile({"num_attention_heads": 30, "num_key_value_heads": 8})


def test_tp_must_split_heads():
    with pytest.raises(DraftsmithError, match="tp 3"):
        plan_tile(LLAMA_31_8B, tp=3)
    with pytest.raises(DraftsmithError, match="num_key_value_heads 12 does not split over tp 8"):
        plan_tile({"num_attention_heads": 48, "num_key_value_heads": 12}, tp=8)


def test_read_from_folder_and_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_8B))
    assert read_target_config(tmp_path) == QWEN3_8B
    assert read_target_config(tmp_path / "config.json") == QWEN3_8B
    assert plan_command(str(tmp_path), tile=128, tp=1).startswith(f"target {tmp_path}\n")


def test_read_multimodal_text_config(tmp_path):
    config = {"model_type": "llava", "vision_config": {"num_attention_heads": 16}, "text_config": MISTRAL_7B}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert plan_tile(read_target_config(tmp_path)).G == 4


def cache_model(cache, name: str, config: dict) -> None:
    """Lay out `name` in a Hugging Face hub cache as a download would."""
    repo = cache / f"models--{name.replace('/', '--')}"
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "snapshots" / "abc123" / "config.json").write_text(json.dumps(config))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")


def test_read_hub_name_from_offline_cache(tmp_path, monkeypatch):
    cache_model(tmp_path, "acme/tiny", LLAMA_3_70B)
    # Remote-code model_type unknown to transformers: read the cached file as it is.
    cache_model(tmp_path, "acme/kimi", {**DEEPSEEK_V3, "model_type": "kimi_k2", "num_attention_heads": 64})
    # huggingface_hub reads HF_HUB_CACHE once at import; the lookup uses this attribute.
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    assert read_target_config("acme/tiny")["num_key_value_heads"] == 8
    assert plan_tile(read_target_config("acme/kimi"), tp=8).G == 8


def test_unknown_target_is_one_line_error(tmp_path):
    with pytest.raises(DraftsmithError, match="not-a/model") as err:
        read_target_config("not-a/model")
    assert "\n" not in str(err.value)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mystery"}))
    with pytest.raises(DraftsmithError, match="num_attention_heads"):
        read_target_config(tmp_path)


def test_plan_prints_the_line_of_each_method_that_declares_one(monkeypatch):
    """The plan knows no method: a line is a method's `plan_line`, printed where it declares one."""
    import dataclasses

    from draftsmith.registry import METHODS

    monkeypatch.setitem(METHODS, "dflash", dataclasses.replace(METHODS["dflash"], plan_line=""))
    text = format_plan(plan_tile(QWEN25_7B))
    assert "DFlash block_size" not in text and "DSpark block_size auto = 16" in text
