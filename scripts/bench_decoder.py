"""Our speculative decoder against transformers' assisted generation, same run.

Same target, same prompts, greedy decoding: plain, prompt lookup (`prompt_lookup_num_tokens`), and a
draft model (`assistant_model`, the same model for both). Prompt lookup runs twice on our
side: with our policy (latest match, periodic extension) and with transformers' (earliest
match, copy stops at the end of the context), the latter giving both engines the same
drafts. Every output is checked token for token against transformers' plain greedy
decoding; then a table of tokens/s, ours/theirs, tau, and our per-pass time split.

tau conventions: ours is committed tokens per verify pass, prefill excluded. transformers
verifies its first draft inside the prefill forward, so its tau here is new tokens per
target forward (also 1.0 for plain decoding); it prints neither.

Without --target the target is a random tiny Llama with the embedded default's shape
(8 layers, 8 query heads over 1 KV head: D = 15). Random weights make any separately
built draft model useless, so its upper layers are damped and the draft model is its
first layers (a truncated twin): cheap, and right often enough to be worth measuring.
With --target (a model folder with its tokenizer, e.g. SmolLM2-135M-Instruct converted
from GGUF) the prompts are the first user turns of --dataset through the target's chat
template, and without --draft the draft model is the target's own first --draft-layers
layers with its final norm and head (a truncated twin of the real weights: a small draft
model both engines run alike).

    python scripts/bench_decoder.py [--target DIR [--draft DIR] --dataset FILE] [--prompts 8 --new-tokens 128]
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time

import torch

from draftsmith.eval.decoder import SpeculativeDecoder, default_num_draft
from draftsmith.eval.proposers import proposer_from_arg
from draftsmith.eval.proposers.base import NoProposer
from draftsmith.models.target import build_tiny_target, decoder_layers, freeze, load_target


def tiny_world(draft_layers: int, damp: float):
    target = build_tiny_target(seed=0, arch="llama", vocab_size=2048, num_layers=8, hidden_size=256,
                               num_heads=8, num_kv_heads=1)
    with torch.no_grad():
        for layer in decoder_layers(target)[draft_layers:]:
            layer.self_attn.o_proj.weight.mul_(damp)
            layer.mlp.down_proj.weight.mul_(damp)
    return freeze(target), truncated_twin(target, draft_layers)


def truncated_twin(target, layers: int):
    """The target's first `layers` decoder layers with its embedding, final norm and head."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(target.config)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    param = next(target.parameters())
    with torch.device(param.device):
        draft = AutoModelForCausalLM.from_config(config, dtype=param.dtype)
    draft.load_state_dict(target.state_dict(), strict=False)  # the upper layers' weights are left out
    draft.generation_config = copy.deepcopy(target.generation_config)
    return freeze(draft)


def dataset_prompts(target_dir: str, dataset: str, count: int) -> list[torch.Tensor]:
    """The first user turn of the first `count` conversations of `dataset`, through the
    target's chat template (eval/prompts.py renders them as eval does)."""
    from draftsmith.data.tokenizer import load_pretrained_tokenizer
    from draftsmith.eval.prompts import eval_conversations, render_turn

    tokenizer = load_pretrained_tokenizer(target_dir)
    turns = eval_conversations(dataset, count)
    template = tokenizer.chat_template or None
    return [torch.tensor(render_turn(tokenizer, conversation[0], template, {}), dtype=torch.long)
            for conversation in turns]


def make_prompts(vocab: int, count: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(torch.randint(16, 48, (1,), generator=g)),), generator=g)
            for _ in range(count)]


class ForwardCounter:
    """Counts target forwards (transformers' verify passes) through a forward hook."""

    def __init__(self, model):
        self.calls = 0
        model.register_forward_pre_hook(self._count)

    def _count(self, *_):
        self.calls += 1


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ours_once(decoder, prompt, new_tokens):
    result = decoder.generate(prompt, new_tokens)
    return result.tokens.tolist(), result.stats.total_s, result.stats


@torch.no_grad()
def hf_once(target, counter, prompt, new_tokens, **kwargs):
    device = next(target.parameters()).device
    counter.calls = 0
    sync(device)
    t0 = time.perf_counter()
    out = target.generate(prompt[None].to(device), max_new_tokens=new_tokens, do_sample=False, **kwargs)
    sync(device)
    return out[0, len(prompt):].tolist(), time.perf_counter() - t0, counter.calls


def fastest(runs):
    """The fastest run (the least disturbed by other load); every run must agree."""
    if any(r[0] != runs[0][0] for r in runs):
        raise RuntimeError("a run's output changed between repeats")
    return min(runs, key=lambda r: r[1])


def measure(decoder, target, counter, prompts, new_tokens, repeats, hf_kwargs):
    """Ours and transformers' alternately, prompt by prompt, so that load hits both alike."""
    ours_runs, hf_runs = [], []
    for prompt in prompts:
        pairs = [(ours_once(decoder, prompt, new_tokens), hf_once(target, counter, prompt, new_tokens, **hf_kwargs))
                 for _ in range(repeats)]
        ours_runs.append(fastest([o for o, _ in pairs]))
        hf_runs.append(fastest([h for _, h in pairs]))
    stats = ours_runs[0][2]
    for r in ours_runs[1:]:
        stats = stats.merge(r[2])
    tokens = sum(len(r[0]) for r in ours_runs)
    ours = {"outputs": [r[0] for r in ours_runs], "tok_s": tokens / sum(r[1] for r in ours_runs),
            "tau": stats.tau, "stats": stats}
    hf = {"outputs": [r[0] for r in hf_runs], "tok_s": tokens / sum(r[1] for r in hf_runs),
          "tau": tokens / sum(r[2] for r in hf_runs)}
    return ours, hf


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", help="a saved Hugging Face causal LM folder (default: a random tiny Llama)")
    ap.add_argument("--draft", help="draft model folder sharing the target's vocabulary (with --target; default: the "
                                    "target's first --draft-layers layers)")
    ap.add_argument("--dataset", default="mt-bench",
                    help="with --target: conversations whose first user turns are the prompts (a benchmark name or "
                         "file eval reads)")
    ap.add_argument("--num-draft", type=int, help="drafts per verify (default: the tile rule)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="runs per prompt and engine; the fastest counts")
    ap.add_argument("--draft-layers", type=int, default=None,
                    help="layers of the truncated-twin draft model (default: 1 for the tiny target, a tenth of a "
                         "real target's)")
    ap.add_argument("--damp", type=float, default=0.05, help="tiny target only: scale of the upper layers' outputs")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    if args.target:
        target = load_target(args.target, device=device)
        if args.draft:
            from transformers import AutoModelForCausalLM

            draft = freeze(AutoModelForCausalLM.from_pretrained(args.draft).to(device))
        else:
            draft = truncated_twin(target, args.draft_layers or max(1, target.config.num_hidden_layers // 10))
        prompts = dataset_prompts(args.target, args.dataset, args.prompts)
    else:
        target, draft = (m.to(device) for m in tiny_world(args.draft_layers or 1, args.damp))
        prompts = make_prompts(target.config.vocab_size, args.prompts, args.seed)
    # Our drafters are built as `eval --drafter` builds them (the registry's proposers; the draft
    # model read from a folder: --draft, or the twin saved), transformers' from the same weights.
    with tempfile.TemporaryDirectory(prefix="bench_decoder_twin_") as twin_dir:  # removed when the run ends
        if not args.draft:
            draft.save_pretrained(twin_dir)
        return compare(args, target, draft, prompts, device, args.draft or twin_dir)


def compare(args, target, draft, prompts, device, draft_dir) -> int:
    """Ours and transformers' greedy decoding of `prompts`, side by side, drafting with `draft` (saved in `draft_dir`)."""
    D = default_num_draft(target.config) if args.num_draft is None else args.num_draft
    eos = target.generation_config.eos_token_id
    pad = target.generation_config.pad_token_id
    pad = pad if pad is not None else (eos if isinstance(eos, int) else 0)
    draft.generation_config.num_assistant_tokens = D
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0  # always draft D, as ours does
    counter = ForwardCounter(target)
    ours = {
        "plain": lambda: SpeculativeDecoder(target, NoProposer(), num_draft=0),
        "prompt lookup": lambda: SpeculativeDecoder(target, proposer_from_arg("ngram", target), num_draft=D),
        "lookup, hf way": lambda: SpeculativeDecoder(target, proposer_from_arg("ngram_earliest", target), num_draft=D),
        "draft model": lambda: SpeculativeDecoder(target, proposer_from_arg(f"draft_lm:{draft_dir}", target),
                                                  num_draft=D),
    }
    theirs = {
        "plain": {},
        "prompt lookup": {"prompt_lookup_num_tokens": D, "max_matching_ngram_size": 4},
        "lookup, hf way": {"prompt_lookup_num_tokens": D, "max_matching_ngram_size": 4},
        "draft model": {"assistant_model": draft},
    }
    draft_name = args.draft or f"truncated twin, {draft.config.num_hidden_layers} layers"
    print(f"target: {args.target or 'random tiny llama (8 layers, H 256, 8q/1kv)'}  draft model: {draft_name}  D = {D}  "
          f"prompts = {len(prompts)}  new tokens = {args.new_tokens}  device = {device}  "
          f"threads = {torch.get_num_threads()}  repeats = {args.repeats} (fastest counts)")

    results = {}
    for name in ours:
        decoder = ours[name]()
        hf_kwargs = {"pad_token_id": pad, **theirs[name]}
        measure(decoder, target, counter, prompts[:1], 8, 1, hf_kwargs)  # warm-up: one-off costs
        results[name] = measure(decoder, target, counter, prompts, args.new_tokens, args.repeats, hf_kwargs)

    reference = results["plain"][1]["outputs"]
    bad = [f"{name} ({who})" for name, pair in results.items() for who, r in zip(("ours", "hf"), pair)
           if r["outputs"] != reference]
    if bad:
        print("OUTPUT MISMATCH against transformers' greedy decoding: " + ", ".join(bad))
        return 1
    print("outputs: identical to transformers' greedy decoding for every method and prompt\n")

    base_ours, base_hf = results["plain"][0]["tok_s"], results["plain"][1]["tok_s"]
    print(f"{'method':<14} {'ours tok/s':>10} {'hf tok/s':>9} {'ours/hf':>8} {'ours/plain':>10} {'hf/plain':>9} "
          f"{'tau ours':>9} {'tau hf':>7}")
    for name, (o, h) in results.items():
        print(f"{name:<14} {o['tok_s']:>10.1f} {h['tok_s']:>9.1f} {o['tok_s'] / h['tok_s']:>8.2f} "
              f"{o['tok_s'] / base_ours:>10.2f} {h['tok_s'] / base_hf:>9.2f} {o['tau']:>9.2f} {h['tau']:>7.2f}")

    t_target = 1000 * results["plain"][0]["stats"].verify_s / results["plain"][0]["stats"].verify_passes
    print(f"\nour time per verify pass, ms (T_target = {t_target:.3f} ms from plain decoding)")
    print(f"{'method':<14} {'verify':>8} {'draft':>8} {'other':>8} {'bound x':>8}")
    for name, (o, _) in results.items():
        s = o["stats"]
        per = [1000 * t / s.verify_passes for t in (s.verify_s, s.draft_s, s.other_s)]
        bound = s.tau * t_target / (per[0] + per[1])
        print(f"{name:<14} {per[0]:>8.3f} {per[1]:>8.3f} {per[2]:>8.3f} {bound:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
