"""A stand-in for vLLM's OpenAI server, so `make test` runs eval's engine path (eval/engine.py)
without the engine: it takes the API server's flags, serves /health, /v1/completions (greedy,
from the model itself through transformers, the prompt as token ids, stop tokens honoured,
`token_ids` returned) and /metrics with speculative counters in vLLM's names. Every pass drafts
D tokens and accepts none, so tau is 1.00 and the drafts counter equals the passes; the steps
histogram counts the prefill's step and one a token; each reply carries its passes' accepted
drafts (all 0) as vLLM's per-request metrics do.

FAKE_VLLM_REFUSE=METHOD makes it exit at start as vLLM's CPU runner refuses a method, in
vLLM's words; FAKE_VLLM_CRASH_TOP_K=1 makes a speculative request with top-k fail as vLLM 0.32's
CPU rejection sampler does. tests/test_engine_columns.py points DRAFTSMITH_ENGINE_PYTHON at a script that
runs this file.
"""

import argparse
import json
import os
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
from transformers import AutoModelForCausalLM


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model")
    parser.add_argument("--port", type=int)
    parser.add_argument("--host")
    parser.add_argument("--speculative-config", default=None)
    args, _ = parser.parse_known_args()
    spec = json.loads(args.speculative_config) if args.speculative_config else None
    if spec and spec["method"] == os.environ.get("FAKE_VLLM_REFUSE"):
        print(f"ValueError: Model Runner V1 does not support: {spec['method']} speculative decoding", flush=True)
        sys.exit(1)
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    counters = {"drafts": 0, "accepted": 0, "steps": 0}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, body: str, kind="application/json"):
            data = body.encode()
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                return self._send("")
            if self.path == "/metrics":
                lines = [f'vllm:spec_decode_num_drafts_total{{engine="0"}} {counters["drafts"]}',
                         f'vllm:spec_decode_num_accepted_tokens_total{{engine="0"}} {counters["accepted"]}',
                         'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 0.0',
                         f'vllm:iteration_tokens_total_count{{engine="0"}} {counters["steps"]}']
                return self._send("\n".join(lines) + "\n", "text/plain")
            self.send_error(404)

        def do_POST(self):
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if spec and request["temperature"] and request.get("top_k") and os.environ.get("FAKE_VLLM_CRASH_TOP_K"):
                # as vLLM 0.32's CPU rejection sampler does with top-k: the engine dies
                print("(Worker pid=1) ERROR 12-07 [multiproc_executor.py:1063] RuntimeError: index -16 is out of "
                      "bounds for dimension 1 with size 300", flush=True)
                print("(APIServer pid=1) ERROR 12-07 [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: "
                      "EngineCore encountered an issue. See stack trace (above) for the root cause.", flush=True)
                self.send_error(500)
                return
            tokens = generate(model, request)
            counters["steps"] += len(tokens)  # the prefill's step, then one a token
            if spec:
                counters["drafts"] += max(0, len(tokens) - 1)
            steps = {"speculative_decoding": {"per_step_accepted": [0] * max(0, len(tokens) - 1)}} if spec else None
            self._send(json.dumps({"id": "fake", "object": "text_completion", "created": 0, "model": args.model,
                                   "choices": [{"index": 0, "text": "", "finish_reason": "length",
                                                "token_ids": tokens}], "metrics": steps}))

    ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()


@torch.no_grad()
def generate(model, request: dict) -> list[int]:
    ids = torch.tensor([request["prompt"]])
    stop, out = set(request.get("stop_token_ids") or []), []
    for _ in range(request["max_tokens"]):
        token = int(model(ids).logits[0, -1].argmax())
        out.append(token)
        if token in stop:
            break
        ids = torch.cat([ids, torch.tensor([[token]])], 1)
    return out


if __name__ == "__main__":
    main()
