"""What eval decodes: benchmark conversations by name or from a file, every user turn of each.

Published acceptance figures are measured over every user turn: MT-bench is scored over
both of its turns, the second asked after the target's own answer to the first (Spec-Bench,
EAGLE, z-lab's DFlash benchmark). `EvalConversation` holds the user side of a conversation,
turn by turn; the decoder writes the answers, and `render_turn` renders the history so far
through the target's chat template, thinking switch included, as the target is served.

Benchmarks by name are read through `datasets` (a hub id: from the Hugging Face cache when
there, see models/hub.py `dataset_source`), each row put into the prompt the
DFlash benchmark (z-lab/dflash `dflash/benchmark.py`) sends, so that tau can be set beside
its tables. Local files of the `turns` shape (Spec-Bench's question.jsonl) and every other
shape data/conversations.py reads keep working.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftsmith.errors import DraftsmithError

# z-lab's math prompts (the Qwen3 model card's reasoning instruction) and code prompt.
_MATH = "{}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
_CODE = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{}\n```"


@dataclass(frozen=True)
class Benchmark:
    hub_id: str
    config: str | None
    split: str
    column: str  # the user text, or (multi_turn) the list of user turns
    template: str = "{}"
    multi_turn: bool = False


BENCHMARKS = {
    "mt-bench": Benchmark("HuggingFaceH4/mt_bench_prompts", None, "train", "prompt", multi_turn=True),
    "gsm8k": Benchmark("openai/gsm8k", "main", "test", "question", _MATH),
    "math500": Benchmark("HuggingFaceH4/MATH-500", None, "test", "problem", _MATH),
    "humaneval": Benchmark("openai/openai_humaneval", None, "test", "prompt", _CODE),
    "mbpp": Benchmark("google-research-datasets/mbpp", "sanitized", "test", "prompt"),
}

# One conversation's user side: the messages before each answer (a system message, if any,
# travels with the first user turn).
EvalConversation = list[list[dict]]


def benchmark_turns(name: str, limit: int) -> list[list[str]]:
    """The user turns of the first `limit` rows of benchmark `name`."""
    import datasets

    from draftsmith.data.conversations import _quiet
    from draftsmith.data.corpus import load_dataset_spec

    bench = BENCHMARKS[name]
    with _quiet(datasets):
        table = load_dataset_spec(bench.hub_id, bench.split, name=bench.config)
    if bench.column not in table.column_names:
        raise DraftsmithError(f"eval dataset {name} ({bench.hub_id}): no column {bench.column!r} "
                              f"(columns: {', '.join(table.column_names)})")
    rows = table.select(range(min(limit, len(table))))[bench.column]
    turns = [row if bench.multi_turn else [row] for row in rows]
    if not all(isinstance(t, list) and t and all(isinstance(x, str) for x in t) for t in turns):
        raise DraftsmithError(f"eval dataset {name} ({bench.hub_id}): column {bench.column!r} is not user text")
    return [[bench.template.format(text) for text in row] for row in turns]


def eval_conversations(dataset: str, limit: int) -> list[EvalConversation]:
    """The user side of the first `limit` conversations of `dataset`: a benchmark name
    (`BENCHMARKS`), or a file, folder or hub dataset data/conversations.py reads."""
    from draftsmith.data.conversations import STDLIB_INSTRUCTIONS, load_conversations
    from draftsmith.data.reply_decoding import user_turns

    if dataset in BENCHMARKS:
        return [[[{"role": "user", "content": text}] for text in turns] for turns in benchmark_turns(dataset, limit)]
    # The built-in instructions are evaluated on the corpus's held-out modules, never those trained on.
    conversations = load_conversations(dataset, limit=limit, split="test" if dataset == STDLIB_INSTRUCTIONS else "")
    out = []
    for index, messages in enumerate(conversations):
        try:
            out.append(user_turns(messages, index))
        except DraftsmithError:
            raise DraftsmithError(f"dataset {dataset}: conversation {index} has no user message") from None
    return out


def render_turn(tokenizer, history: list[dict], template: str | None, template_kwargs: dict) -> list[int]:
    """Token ids of the prompt that asks for the next answer after `history`: through the chat
    template (with its generation prompt), or the contents as plain text for a tokenizer
    without one."""
    from draftsmith.data.chat import render_text

    if template is None:
        return tokenizer(render_text(tokenizer, history, None), add_special_tokens=True)["input_ids"]
    text = render_text(tokenizer, history, template, add_generation_prompt=True, template_kwargs=template_kwargs)
    return tokenizer(text, add_special_tokens=False)["input_ids"]  # the template writes its own BOS
