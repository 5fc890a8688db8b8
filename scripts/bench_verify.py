"""The two device measurements of scripts/gpu_check.sh: where the verify pass leaves its
attention tile, and what each drafter's decoding is worth.

1. Verify latency against the number of query tokens Q = 1 + D (1..64), at G = 4, 8, 16
   query heads per KV head, on a 1B-class target (hidden 2048, 16 layers, 32 query heads of
   dim 64 over 8/4/2 KV heads, vocab 128256, as Llama-3.2-1B) with a 4096-token KV cache.
   Three measures per point:
   - `wall`: one target verify forward as the decoder runs it (models.target.target_forward
     on a DynamicCache, cropped back after each call), CUDA events around it; an eager
     forward at batch 1 may be bound by kernel launches, which the next measure leaves out;
   - `kernel`: the summed GPU time of that forward's kernels (torch.profiler), about what
     an engine replaying CUDA graphs pays;
   - `attn`: the attention alone, laid out as packing kernels lay it out (FA3's PackGQA,
     FlashInfer, FlashMLA): the G heads of a KV head and the Q tokens as G*Q rows of one
     problem, over 4096 + Q keys (the causal mask among the Q new keys is left out: Q of
     4096 columns), batched so that one tile per KV head is already 4 CTAs per SM: every
     extra tile is then extra work, not extra parallelism on idle SMs.
   The tile rule predicts a step in `attn` between Q* = 128 // G and Q* + 1. The target's
   own attention (flash_attention_2 or SDPA) does not pack heads for Q > 1 (FA2 swaps
   heads into rows for Q == 1 only), so `wall` and `kernel` need not step at Q*: that is
   the point of comparing them.
2. The decoder's speedup over plain decoding for each drafter, on the G = 4 target:
   ngram, a truncated-twin draft model, the target drafting for itself (oracle: tau = 1 + D),
   and untrained EAGLE-3 (chain, and tree on SDPA), DFlash and DSpark, whose tau is about 1
   but whose T_draft is real. The eval machinery measures (eval/evaluate.py) and reports
   (eval/report.py); at bf16 a near-tie between two logits may flip an argmax between the
   verify and the plain forward, so outputs that differ from plain decoding are counted,
   not fatal (tests/test_gpu.py checks losslessness up to such ties).

    python scripts/bench_verify.py --out DIR [--cpu-dry-run]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decoder import truncated_twin  # noqa: E402  (the decoder benchmark's draft model)
from bench_train import Clock, build_target  # noqa: E402  (shared with the training benchmark)

from draftsmith.models.target import target_forward  # noqa: E402
from draftsmith.models.target_cache import crop_cache, new_cache  # noqa: E402

SHAPE = dict(hidden_size=2048, num_layers=16, num_heads=32, intermediate_size=8192, vocab_size=128256)
DRY_SHAPE = dict(hidden_size=128, num_layers=4, num_heads=16, intermediate_size=256, vocab_size=512)
KV_HEADS = (8, 4, 2)  # G = 4, 8, 16 with 32 query heads (DRY_SHAPE: 4, 2, 1 -> the same G)


def flash_attn_version() -> str | None:
    try:
        import flash_attn
    except ImportError:
        return None
    return getattr(flash_attn, "__version__", "unknown")


# ---- 1. verify latency ----------------------------------------------------------------

def kernel_ms(calls: dict, reps: int) -> dict:
    """{Q: mean summed GPU time (ms) of one call's kernels} from one profiler session:
    each Q's calls run inside a named range, whose device time the profiler sums over the
    kernels that the ops inside it launched. {} where there is no GPU or no profiler."""
    if not torch.cuda.is_available():
        return {}
    from torch.autograd import DeviceType
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for n, (fn, reset) in calls.items():
                with record_function(f"verify_q{n}"):
                    for _ in range(reps):
                        fn()
                        reset()
                    torch.cuda.synchronize()
        busy = {int(e.name.removeprefix("verify_q")): e.device_time_total for e in prof.events()
                if e.name.startswith("verify_q") and e.device_type == DeviceType.CPU}
    except Exception as exc:  # a profiler that cannot run here must not cost the other numbers
        print(f"  profiler unavailable ({type(exc).__name__}: {exc}); kernel times left out")
        return {}
    return {n: us / 1e3 / reps for n, us in busy.items() if us > 0}


def wall_ms(clock: Clock, fn, reset, reps: int) -> float:
    samples = []
    for _ in range(reps):
        start = clock.mark()
        fn()
        end = clock.mark()
        samples.append(clock.ms(start, end))
        reset()
    return statistics.median(samples)


def packed_attention(batch, kv_heads, group, q_max, kv_len, head_dim, device, dtype):
    """attn(Q) -> ms for the packed layout (module doc); returns (callable, backend name)."""
    g = torch.Generator(device=device).manual_seed(0)
    # Random data (zeros run faster than real data); one buffer of the longest keys, sliced.
    shape = (batch, kv_len + q_max, kv_heads, head_dim)  # flash-attn layout [B, L, heads, d]
    k = torch.randn(shape, generator=g, device=device, dtype=dtype)
    v = torch.randn(shape, generator=g, device=device, dtype=dtype)
    q = torch.randn((batch, group * q_max, kv_heads, head_dim), generator=g, device=device, dtype=dtype)
    clock = Clock(device)
    if device.type == "cuda" and flash_attn_version():
        from flash_attn import flash_attn_func

        name = "flash_attn.flash_attn_func (FA2)"
        run = lambda n: flash_attn_func(q[:, : group * n], k[:, : kv_len + n], v[:, : kv_len + n])  # noqa: E731
    else:
        import contextlib

        from torch.nn.functional import scaled_dot_product_attention as sdpa

        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # SDPA layout [B, heads, L, d]

        def run(n):
            with context():
                return sdpa(qt[:, :, : group * n], kt[:, :, : kv_len + n], vt[:, :, : kv_len + n])

        name, context = "torch SDPA (CPU)", contextlib.nullcontext
        if device.type == "cuda":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            name, context = "torch SDPA, flash backend (FA2 port)", lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION)
            try:
                run(1)
            except RuntimeError as exc:  # no flash kernel for this build or shape: say so, measure anyway
                name, context = f"torch SDPA, default backend (flash refused: {str(exc)[:80]})", contextlib.nullcontext

    def measure(n: int, reps: int) -> float:
        run(n)  # warm-up: the first call of a shape picks its kernel
        return wall_ms(clock, lambda: run(n), lambda: None, reps)

    return measure, name


def verify_sweep(args, device, dtype, attn: str, after_each) -> dict:
    """Per G: Q, wall ms, kernel ms, packed attention ms. `after_each(result, target, kv)`
    runs while each target is still built (the decoder benchmark reuses one, and the
    results so far are saved, so that a run stopped at its time limit keeps them)."""
    shape = DRY_SHAPE if args.cpu_dry_run else SHAPE
    kv_list = [h * shape["num_heads"] // 32 for h in KV_HEADS]
    clock = Clock(device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    head_dim = shape["hidden_size"] // shape["num_heads"]
    dtype_name = str(dtype).removeprefix("torch.")
    result = {"shape": {**shape, "head_dim": head_dim, "kv_len": args.kv_len, "dtype": dtype_name,
                        "attn_implementation": attn, "tile": args.tile, "ctas_per_sm": args.ctas_per_sm, "sms": sms},
              "sweep": {}}
    for kv in kv_list:
        group = shape["num_heads"] // kv
        target = build_target(device, dtype, attn, num_kv_heads=kv,
                              max_position_embeddings=args.kv_len + args.q_max + 64, **shape)
        gen = torch.Generator().manual_seed(kv)
        cache = new_cache(target)
        prompt = torch.randint(0, shape["vocab_size"], (1, args.kv_len), generator=gen).to(device)
        with torch.no_grad():
            target_forward(target, prompt, cache=cache, logits_to_keep=1)
        batch = max(1, math.ceil(args.ctas_per_sm * sms / kv)) if device.type == "cuda" else 1
        attn_ms, result["shape"]["packed_attention"] = packed_attention(batch, kv, group, args.q_max, args.kv_len,
                                                                       head_dim, device, dtype)
        rows = {"q": [], "wall_ms": [], "kernel_ms": [], "attn_ms": []}
        print(f"G = {group} ({kv} KV heads): verify forward and packed attention (batch {batch}), "
              f"Q = 1..{args.q_max}", flush=True)
        calls = {}
        for n in range(1, args.q_max + 1):
            tokens = torch.randint(0, shape["vocab_size"], (1, n), generator=gen).to(device)
            verify = torch.no_grad()(lambda tokens=tokens: target_forward(target, tokens, cache=cache))  # noqa: F821
            reset = lambda: crop_cache(cache, args.kv_len)  # noqa: E731, F821
            verify()  # warm-up for this shape
            reset()
            calls[n] = (verify, reset)
            rows["q"].append(n)
            rows["wall_ms"].append(wall_ms(clock, verify, reset, args.reps))
            rows["attn_ms"].append(attn_ms(n, args.reps))
        kernels = kernel_ms(calls, max(1, args.reps // 3))
        rows["kernel_ms"] = [kernels.get(n) for n in rows["q"]]
        result["sweep"][group] = {"kv_heads": kv, "attn_batch": batch, **rows}
        after_each(result, target, kv)
        del target, cache
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return result


def _ratio(values, i, j) -> str:
    a, b = values[i], values[j]
    return "-" if a is None or b is None or not b else f"{a / b:.2f}"


def verify_markdown(result: dict) -> str:
    s, sweep = result["shape"], result["sweep"]
    tile = s["tile"]
    lines = [
        "## Verify latency against query tokens",
        "",
        f"Target: hidden {s['hidden_size']}, {s['num_layers']} layers, {s['num_heads']} query heads of dim "
        f"{s['head_dim']}, vocab {s['vocab_size']}, {s['dtype']}, attn_implementation `{s['attn_implementation']}`; "
        f"KV cache {s['kv_len']} tokens, batch 1. Packed attention: {s['packed_attention']}, G*Q rows per KV head "
        f"over {s['kv_len']} + Q keys, batch sized to {s['ctas_per_sm']} CTAs per SM per tile ({s['sms']} SMs).",
        "",
        f"Step at the tile edge: Q* = {tile} // G is the last Q whose G*Q rows fit one {tile}-row tile. "
        "`step` = t(Q*+1)/t(Q*), `slope` = t(Q*)/t(Q*-1) for comparison; the rule predicts a step well "
        "above the slope in `attn`.",
        "",
        "| G | KV heads | Q* | wall step | wall slope | kernel step | kernel slope | attn step | attn slope |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for group, r in sweep.items():
        edge = tile // int(group)
        i = r["q"].index(edge) if edge in r["q"] and edge + 1 in r["q"] else None
        cells = [str(group), str(r["kv_heads"]), str(edge)]
        for key in ("wall_ms", "kernel_ms", "attn_ms"):
            cells += ["-", "-"] if i is None or i == 0 else [_ratio(r[key], i + 1, i), _ratio(r[key], i, i - 1)]
        lines.append("| " + " | ".join(cells) + " |")
    groups = list(sweep)
    lines += ["", "Full sweep (ms; attn is one packed attention call; kernel: summed GPU kernel time):", "",
              "| Q | " + " | ".join(f"G={g} wall | G={g} kernel | G={g} attn" for g in groups) + " |",
              "|---:|" + "---:|" * (3 * len(groups))]
    fmt = lambda x: "-" if x is None else f"{x:.4f}"  # noqa: E731
    for j, q in enumerate(sweep[groups[0]]["q"]):
        cells = [str(q)] + [fmt(sweep[g][k][j]) for g in groups for k in ("wall_ms", "kernel_ms", "attn_ms")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def verify_plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tile, sweep = result["shape"]["tile"], result["sweep"]
    panels = [("wall_ms", "verify forward, wall (ms)"), ("kernel_ms", "verify forward, GPU kernels (ms)"),
              ("attn_ms", "packed attention (ms)")]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, (key, title) in zip(axes, panels):
        for k, (group, r) in enumerate(sweep.items()):
            color = f"C{k}"
            points = [(q, y) for q, y in zip(r["q"], r[key]) if y is not None]
            if points:
                ax.plot(*zip(*points), marker=".", color=color, label=f"G={group}")
            ax.axvline(tile // int(group) + 0.5, color=color, linestyle=":", linewidth=1)
        measured = any(y is not None for r in sweep.values() for y in r[key])
        ax.set_title(title if measured else title + ": n/a")
        ax.set_xlabel("query tokens Q = 1 + D")
        ax.grid(alpha=0.3)
        if measured:
            ax.legend(fontsize=8)
    fig.suptitle(f"dotted: Q = {tile} // G + 0.5, where G*Q leaves one {tile}-row tile")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- 2. decoder speedup ---------------------------------------------------------------

def build_proposers(target, folder: Path) -> dict:
    """Each drafter as `eval --drafter` builds it (the registry's proposers, read from folders
    saved in `folder`): n-gram lookup, a truncated-twin draft model, the target drafting for
    itself (the oracle), and an untrained drafter of every method trained on the target's
    features, built by its training class (`new_drafter`), with its decode variants."""
    from draftsmith.eval.proposers import proposer_from_arg
    from draftsmith.fields import DEFAULT_TILE
    from draftsmith.models.native import save_drafter
    from draftsmith.registry import METHODS
    from draftsmith.train.method import StepShape

    param, config = next(target.parameters()), target.config
    # The reference sizes (no layer count asked, a 32k draft vocabulary where a method has one),
    # the last token id free to be a mask token.
    shape = StepShape(vocab_size=config.vocab_size, draft_vocab_size=min(config.vocab_size, 32000), anchors=512,
                      drafter_layers=0, target_layers=config.num_hidden_layers)
    truncated_twin(target, 2).save_pretrained(folder / "twin")
    target.save_pretrained(folder / "oracle")
    args = {"ngram": "ngram", "draft_lm": f"draft_lm:{folder / 'twin'}", "oracle": f"oracle=draft_lm:{folder / 'oracle'}"}
    for spec in METHODS.values():
        if not spec.reads_target_features:
            continue
        training = spec.load("training")
        with torch.device(param.device):
            drafter = training.new_drafter(target, training.step_keys(shape), DEFAULT_TILE).to(param.dtype).eval()
        save_drafter(drafter, folder / spec.name)
        args.update({name: f"{name}:{folder / spec.name}" for name in (spec.name, *spec.variants)})
    return {name: proposer_from_arg(arg, target) for name, arg in args.items()}


def decoder_speedup(target, args, out_dir: Path) -> dict:
    """Every drafter against plain decoding of the same target and prompts, in one run,
    through eval/evaluate.py's decode loop and eval/report.py's report."""
    from draftsmith.errors import DraftsmithError
    from draftsmith.eval.decoder import SpeculativeDecoder
    from draftsmith.eval.decoding import decode_prompts, merge_stats, per_pass_ms, tokens_per_s
    from draftsmith.eval.proposers.base import GREEDY, NoProposer
    from draftsmith.eval.report import speedup_bound, write_report
    from draftsmith.eval.settings import EvalSettings
    from draftsmith.models.tile import plan_tile
    from draftsmith.registry import METHODS

    config = target.config
    plan = plan_tile(config.to_dict(), tile=args.tile)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, config.vocab_size - 1, (int(torch.randint(32, 96, (1,), generator=gen)),),
                             generator=gen) for _ in range(args.prompts)]
    settings = EvalSettings(dataset="random tokens", num_prompts=len(prompts), max_new_tokens=args.new_tokens, seed=0)
    plain = SpeculativeDecoder(target, NoProposer(), num_draft=0, eos_token_id=())
    plain.generate(prompts[0][:8], 4)  # warm-up
    base_runs, base_out = decode_prompts(plain, prompts, settings, GREEDY, "plain decoding")
    base_stats = merge_stats(base_runs)
    t_target, base_tps = per_pass_ms(base_stats, base_stats.verify_s), tokens_per_s(base_stats, base_out)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        proposers = build_proposers(target, Path(folder))
    for name, proposer in proposers.items():
        decoder = SpeculativeDecoder(target, proposer, num_draft=plan.D, eos_token_id=())
        try:
            decoder.generate(prompts[0][:8], 4)  # warm-up
        except DraftsmithError as exc:  # a tree under flash-attn, which ignores the 4D mask it needs
            print(f"  {name}: skipped ({exc})")
            continue
        runs, out = decode_prompts(decoder, prompts, settings, GREEDY, name)
        stats = merge_stats(runs)
        t_draft, t_verify = per_pass_ms(stats, stats.draft_s), per_pass_ms(stats, stats.verify_s)
        tps = tokens_per_s(stats, out)
        extra = {"prompts unlike plain": sum(a != b for a, b in zip(out, base_out)), **proposer.report_extra()}
        is_untrained = any(name in (spec.name, *spec.variants) for spec in METHODS.values() if spec.reads_target_features)
        rows.append({
            "name": name, "drafter": f"{name} (untrained)" if is_untrained else name, "num_draft": plan.D,
            "tau": stats.tau, "verify_passes": stats.verify_passes, "committed_tokens": stats.committed,
            "per_position_acceptance": stats.per_position_acceptance,
            "accepted_length_hist": list(stats.accepted_hist), "tokens_per_s": tps,
            "speedup": tps / max(base_tps, 1e-9), "bound": speedup_bound(stats.tau, t_target, t_draft, t_verify),
            "T_draft_ms": t_draft, "T_verify_ms": t_verify, "extra": extra,
        })
        print(f"  {name}: tau {stats.tau:.2f}, {tps:.1f} tok/s ({rows[-1]['speedup']:.2f}x plain)")
    shape = f"random llama: hidden {config.hidden_size}, {config.num_hidden_layers} layers, vocab {config.vocab_size}"
    results = {
        "target": {"path": shape, "H": plan.H, "KV": plan.KV, "G": plan.G, "tile": plan.tile, "D": plan.D},
        "settings": {"dataset": settings.dataset, "num_prompts": len(prompts), "max_new_tokens": args.new_tokens,
                     "temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 0},
        "plain": {"tokens_per_s": base_tps, "T_target_ms": t_target},
        "drafters": rows,
    }
    write_report(results, out_dir)
    return results


# ---- the run ------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("runs/gpu_check"))
    ap.add_argument("--cpu-dry-run", action="store_true", help="tiny shapes on the CPU: exercises every code path")
    ap.add_argument("--kv-len", type=int, help="tokens in the KV cache (default 4096)")
    ap.add_argument("--q-max", type=int, help="largest verify width Q (default 64)")
    ap.add_argument("--reps", type=int, help="timed calls per point, median (default 10)")
    ap.add_argument("--tile", type=int, help="rows per attention tile (default 128)")
    ap.add_argument("--ctas-per-sm", type=int, default=4, help="packed attention: tiles per SM at one tile per head")
    ap.add_argument("--prompts", type=int, help="decoder benchmark prompts (default 4)")
    ap.add_argument("--new-tokens", type=int, help="tokens per prompt (default 128)")
    ap.add_argument("--skip-decoder", action="store_true")
    args = ap.parse_args(argv)
    dry = args.cpu_dry_run
    # The dry run keeps every step but shrinks it: a 16-row tile puts the edges at Q* = 4, 2, 1.
    defaults = {"kv_len": (4096, 64), "q_max": (64, 6), "reps": (10, 2), "tile": (128, 16), "prompts": (4, 1),
                "new_tokens": (128, 8)}
    for name, (full, small) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, small if dry else full)
    if not dry and not torch.cuda.is_available():
        ap.error("no CUDA device: run with --cpu-dry-run to exercise the code paths on the CPU")
    device = torch.device("cpu" if dry else "cuda")
    dtype = torch.float32 if dry else torch.bfloat16
    attn = "flash_attention_2" if (device.type == "cuda" and flash_attn_version()) else "sdpa"
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (dry run)"
    print(f"device {name}, torch {torch.__version__}, "
          f"flash-attn {flash_attn_version() or 'not installed'}: target attention {attn}")
    args.out.mkdir(parents=True, exist_ok=True)

    def after_each(result, target, kv):
        if not args.skip_decoder and kv == target.config.num_attention_heads // 4:  # the G = 4 target
            print("decoder speedup on the G = 4 target:")
            with tempfile.TemporaryDirectory() as tmp:
                result["decoder"] = decoder_speedup(target, args, Path(tmp) / "report")
                for plot in ("speedup", "acceptance"):
                    shutil.copy(Path(tmp) / "report" / f"{plot}.png", args.out / f"decoder_{plot}.png")
        save(result, args.out)

    from draftsmith.fsutil import output_lock

    with output_lock(args.out):  # one sweep into one folder at a time
        result = verify_sweep(args, device, dtype, attn, after_each)
    print(markdown(result))
    return 0


def markdown(result: dict) -> str:
    md = verify_markdown(result)
    if "decoder" in result:
        from draftsmith.eval.report import TAU_NOTE, format_table

        d = result["decoder"]
        md += ("\n\n## Decoder speedup over plain decoding\n\n"
               f"{d['target']['path']}, G = {d['target']['G']}, D = {d['target']['D']}; {d['settings']['num_prompts']} "
               f"random prompts, {d['settings']['max_new_tokens']} new tokens, greedy. EAGLE-3, DFlash and DSpark "
               "are untrained: their tau is about 1, their T_draft is what they cost.\n\n"
               + format_table(d) + "\n\n" + TAU_NOTE)
    return md


def save(result: dict, out: Path) -> None:
    """The sweep so far, each file replaced whole (a GPU lease may end mid-sweep)."""
    from draftsmith.fsutil import atomic_file

    with atomic_file(out / "verify.md") as f:
        f.write(markdown(result) + "\n")
    with atomic_file(out / "verify.json") as f:
        f.write(json.dumps(result, indent=1, default=str))
    verify_plot(result, out / "verify.png")


if __name__ == "__main__":
    sys.exit(main())
