"""Regeneration in-process (`generate` in fixed batches) against the server path (requests
in flight to an OpenAI-compatible server), same target, same prompts, same run.

Both write the same file shape; tokens/s counts the reply tokens of each file (the target's
tokenizer) over the wall-clock time of the whole regeneration. Without --server the script
starts `transformers serve` on 127.0.0.1 (continuous batching unless --no-continuous-batching),
or with --engine vllm the vLLM engine (`make engine`, eval/engine.py), and sends it one warm-up
request first, outside the timing. Greedy rows are checked equal; sampled ones (--temperature,
--top-p, --top-k: the references regenerate at 0.7, 0.8, 20) are the paths' own draws, so only
their tokens/s compare.

Without --target the target is the tiny one the tests use (random weights, so replies run
to the token limit: every reply costs the same number of tokens on both paths).

    python scripts/bench_regenerate.py [--target DIR] [--server URL | --engine vllm] [--prompts 32 --new-tokens 64]
                                       [--temperature 0.7 --top-p 0.8 --top-k 20] [--in-flight 16]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch


def tiny_target(folder: Path) -> Path:
    from draftsmith.data.corpus import load_embedded_corpus
    from draftsmith.data.tokenizer import train_tokenizer
    from draftsmith.models.target import build_tiny_target

    tokenizer = train_tokenizer(load_embedded_corpus("train", max_chars=150_000), vocab_size=512)
    model = build_tiny_target(vocab_size=len(tokenizer), num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=1)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def reply_tokens(path: Path, tokenizer) -> int:
    rows = [json.loads(line)["messages"] for line in path.read_text().splitlines()]
    return sum(len(tokenizer(m["content"], add_special_tokens=False)["input_ids"])
               for row in rows for m in row if m["role"] == "assistant")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=None, help="a model folder (default: a tiny random target)")
    parser.add_argument("--server", default=None, help="an OpenAI-compatible server serving --target")
    parser.add_argument("--engine", choices=["vllm"], default=None, help="start the vLLM engine instead of "
                        "transformers serve (make engine)")
    parser.add_argument("--no-continuous-batching", action="store_true")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-chars", type=int, default=200)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8, help="in-process generate batch")
    parser.add_argument("--in-flight", type=int, default=16, help="server requests in flight")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (rows compared)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from draftsmith.data.local_server import LocalServer
    from draftsmith.data.regen_server import decoding_for, regenerate_via_servers
    from draftsmith.data.regenerate import embedded_conversations, regenerate
    from draftsmith.data.reply_decoding import ReplyDecoding
    from draftsmith.data.server_client import ServerClient
    from draftsmith.data.server_endpoint import Limits
    from draftsmith.data.tokenizer import load_pretrained_tokenizer
    from draftsmith.models.target import load_target

    work = Path(tempfile.mkdtemp(prefix="bench-regenerate-"))
    target_dir = Path(args.target) if args.target else tiny_target(work / "tiny")
    tokenizer = load_pretrained_tokenizer(target_dir)
    device = "cuda" if torch.cuda.is_available() else None
    conversations = [[{"role": "user", "content": c[0]["content"]}]
                     for c in embedded_conversations(args.prompts, args.prompt_chars)]
    how = ReplyDecoding(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                        max_new_tokens=args.new_tokens)
    sampling = decoding_for(target_dir, tokenizer, how, False)
    limits = Limits(in_flight=args.in_flight)

    server = None
    if args.engine:
        from draftsmith.data.vllm_server import Served, VllmServer, engine_python
        from draftsmith.models.serve import engine_args

        plain = Served("plain", str(target_dir), engine_args(target_dir)[1])
        server = VllmServer(engine_python(), plain, work / "serve.log", max_model_len=4096)
    elif args.server is None:
        server = LocalServer(target_dir, work / "serve.log", continuous_batching=not args.no_continuous_batching,
                             device=device or "cpu", threads=args.threads or None)
    url = args.server or server.url
    try:
        # Warm-up outside the timing: the first request loads the model (and sets up batching).
        client = ServerClient(url, (str(target_dir),), tokenizer, False, sampling, limits)
        client.complete(conversations[0], 0)

        model = load_target(target_dir, device=device)
        start = time.perf_counter()
        local = regenerate(model, tokenizer, conversations, work / "local.jsonl", how, batch_size=args.batch_size)
        local_s = time.perf_counter() - start
        del model

        start = time.perf_counter()
        served = regenerate_via_servers([url], str(target_dir), tokenizer, conversations, work / "served.jsonl",
                                        sampling, limits=limits)
        served_s = time.perf_counter() - start
        same = local.read_text() == served.read_text()
        kind = f"vLLM {args.in_flight} in flight" if args.engine else f"{args.in_flight} in flight" + (
            ", continuous batching" if server is not None and not args.no_continuous_batching else "")
        rows = [("in-process generate", f"batch {args.batch_size}", reply_tokens(local, tokenizer), local_s),
                ("server", kind, reply_tokens(served, tokenizer), served_s)]
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)

    drawn = f"temperature {args.temperature}, top-p {args.top_p}, top-k {args.top_k}" if args.temperature else "greedy"
    print(f"\n{len(conversations)} prompts, up to {args.new_tokens} new tokens, {drawn}; target {target_dir}\n")
    print("| path | setting | reply tokens | seconds | tokens/s |")
    print("|---|---|---|---|---|")
    for name, setting, tokens, seconds in rows:
        print(f"| {name} | {setting} | {tokens} | {seconds:.2f} | {tokens / seconds:.1f} |")
    ratio = (rows[1][2] / rows[1][3]) / (rows[0][2] / rows[0][3])
    rows_check = ("yes" if same else "NO") if not args.temperature else "not compared (sampled: each path's own draws)"
    print(f"\nserver / in-process tokens/s: {ratio:.2f}x; rows identical: {rows_check}")
    return 0  # a mismatch is reported, not failed: bf16 kernels on a GPU may round differently


if __name__ == "__main__":
    sys.exit(main())
