"""Tiny tokenizers that render chats exactly as Qwen3 and Llama 3.1 do: each model's public
chat template (tests/fixtures/chat_templates/) and its special tokens on a small byte-level
BPE vocabulary, so that rendered text and loss masks can be checked token by token on CPU."""

from __future__ import annotations

from pathlib import Path

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"

# Special tokens as the models' tokenizer_config.json declares them (a subset: the ones the
# templates write). Qwen3 writes <think> and </think> as added (not special) tokens.
FAMILIES = {
    "qwen3": {"template": "qwen3.jinja", "special": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
              "added": ["<think>", "</think>"], "eos": "<|im_end|>", "pad": "<|endoftext|>", "bos": None},
    "llama31": {"template": "llama31.jinja",
                "special": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                            "<|eot_id|>", "<|eom_id|>", "<|python_tag|>", "<|finetune_right_pad_id|>"],
                "added": [], "eos": "<|eot_id|>", "pad": "<|finetune_right_pad_id|>", "bos": "<|begin_of_text|>"},
}

_TEXT = [
    "The quick brown fox jumps over the lazy dog. Answer briefly, please.",
    "def square(x):\n    return x * x\n", "What is two plus two? Two plus two is four.",
    "Let me think step by step about the question before answering it.",
    "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n", "system user assistant",
]


def template_text(family: str) -> str:
    return (TEMPLATES / FAMILIES[family]["template"]).read_text()


def tiny_chat_tokenizer(family: str, vocab_size: int = 320):
    """A `PreTrainedTokenizerFast` with `family`'s chat template and special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    spec = FAMILIES[family]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=spec["special"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(_TEXT * 4, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=spec["eos"], pad_token=spec["pad"],
                                        bos_token=spec["bos"], chat_template=template_text(family),
                                        clean_up_tokenization_spaces=False)
    tokenizer.add_special_tokens({"additional_special_tokens": [t for t in spec["special"]
                                                                if t not in (spec["eos"], spec["pad"], spec["bos"])]})
    if spec["added"]:
        tokenizer.add_tokens(spec["added"])
    return tokenizer


def save_tiny_chat_target(family: str, folder, arch: str = "llama", seed: int = 0, num_layers: int = 4):
    """A tiny random target folder (config, weights, tokenizer, generation config) that chats
    as `family` does: its template, special tokens and end-of-turn as generation stop."""
    from draftsmith.models.target import build_tiny_target

    tokenizer = tiny_chat_tokenizer(family)
    model = build_tiny_target(seed=seed, arch=arch, vocab_size=len(tokenizer), num_layers=num_layers, hidden_size=64,
                              num_heads=4, num_kv_heads=1)
    eos = tokenizer.convert_tokens_to_ids(FAMILIES[family]["eos"])
    model.config.eos_token_id = model.generation_config.eos_token_id = eos
    model.config.pad_token_id = model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model.eval(), tokenizer
