"""The tokenizer of the embedded default: a byte-level BPE trained on the corpus's train part.

Byte-level, so any text (code, unicode) round-trips exactly with no unknown token. It
reserves the special tokens the drafters and chat data need, and carries a ChatML template
whose assistant replies sit inside `{% generation %}` blocks, so transformers can return
the loss mask of a conversation (`return_assistant_tokens_mask=True`). The end-of-turn
`<|im_end|>` is inside the block: a drafter must learn to predict where a reply stops.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from draftsmith.errors import DraftsmithError, first_lines
from draftsmith.fsutil import atomic_dir

EOS, IM_START, IM_END, PAD, MASK = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>", "<|mask|>"
SPECIAL_TOKENS = (EOS, IM_START, IM_END, PAD, MASK)  # ids 0..4, in this order

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str | Path | None = None):
    """Train a byte-level BPE on `texts`; deterministic for the same texts and size.

    Returns a `PreTrainedTokenizerFast`; with `out_dir`, it is also saved there (atomically)
    so that `AutoTokenizer.from_pretrained(out_dir)` loads it back.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    floor = len(SPECIAL_TOKENS) + 256  # the specials and every byte
    if vocab_size < floor:
        raise DraftsmithError(f"tokenizer: vocab_size {vocab_size} is below {floor} (special tokens plus 256 bytes)")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    # Untrimmed offsets: the loss mask maps template character spans onto tokens.
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer=trainer)
    if bpe.get_vocab_size() < vocab_size:
        raise DraftsmithError(f"tokenizer: the training text yields {bpe.get_vocab_size()} tokens, "
                              f"fewer than vocab_size {vocab_size}; give it more text")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token=EOS,
        pad_token=PAD,
        mask_token=MASK,
        extra_special_tokens=[IM_START, IM_END],
        chat_template=CHATML_TEMPLATE,
        padding_side="right",
        clean_up_tokenization_spaces=False,  # it would eat spaces in code on decode
    )
    if out_dir is not None:
        with atomic_dir(out_dir) as tmp:
            tokenizer.save_pretrained(tmp)
    return tokenizer


def load_pretrained_tokenizer(source: str | Path, what: str = "target"):
    """AutoTokenizer.from_pretrained with one line naming `source` for whatever a missing or
    corrupt tokenizer file makes transformers or tokenizers raise."""
    from transformers import AutoTokenizer

    text = str(source)
    if not Path(text).exists() and (Path(text).is_absolute() or text.startswith(".") or text.count("/") > 1):
        raise DraftsmithError(f"{what} {source}: no such folder (nor a hub name)")
    try:
        return AutoTokenizer.from_pretrained(text)
    except Exception as exc:
        raise DraftsmithError(f"cannot load the tokenizer of {what} {source}: {first_lines(exc)}") from None


def check_fits(tokenizer, vocab_size: int | None, source, target) -> None:
    """Refuse a tokenizer with more tokens than the target's vocabulary: its high ids would
    index past the embedding, an error deep inside a forward pass."""
    if vocab_size and len(tokenizer) > vocab_size:
        raise DraftsmithError(f"the tokenizer of {source} has {len(tokenizer)} tokens, more than the {vocab_size} "
                              f"of target {target}'s vocabulary; use the target's own tokenizer")


def choose_mask_token(tokenizer, vocab_size: int, rows: list) -> tuple[int, str]:
    """The token id DFlash and DSpark fill a block's unknown slots with, and why that one.

    The block is embedded with the target's own frozen embedding, in training and in the
    engines (SGLang and vLLM embed `mask_token_id` through the target's embedding), so the
    mask must be a row of that embedding: a row the drafter owned would be a parameter no
    engine layout carries. In order: the tokenizer's mask token; the first embedding row
    past the tokenizer's tokens (the padded rows of a 151,936-row Qwen3 embedding, where
    z-lab's Qwen3 drafters put theirs); else the last special token that is not BOS, EOS,
    padding or unknown and never occurs in the training rows (SmolLM2's 49,152 rows are all
    tokens: its `<empty_output>`), so that no real input looks like a mask."""
    import torch

    if tokenizer.mask_token_id is not None:
        return int(tokenizer.mask_token_id), f"the tokenizer's mask token {tokenizer.mask_token!r}"
    if len(tokenizer) < vocab_size:
        return len(tokenizer), (f"embedding row {len(tokenizer)}, the first past the tokenizer's "
                                f"{len(tokenizer)} tokens (the target's embedding has {vocab_size} rows)")
    reserved = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    special = sorted({i for i, t in tokenizer.added_tokens_decoder.items() if t.special} - reserved)
    seen = torch.zeros(vocab_size, dtype=torch.bool)
    for ids in rows:
        seen[ids.reshape(-1).clamp(0, vocab_size - 1)] = True
    unused = [i for i in special if i < vocab_size and not seen[i]]
    if not unused:
        raise DraftsmithError(f"no mask token: the tokenizer has none, the target's {vocab_size} embedding rows are "
                              "all tokens, and every special token occurs in the training rows; set "
                              "method.mask_token_id to a token id the data never uses")
    chosen = unused[-1]
    return chosen, (f"special token {tokenizer.convert_ids_to_tokens(chosen)!r} (id {chosen}), which never occurs "
                    "in the training rows: the tokenizer has no mask token and the embedding no spare row")
