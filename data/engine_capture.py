"""The feature cache's target forward run by the serving engine (`draftsmith data cache-hidden
--engine vllm`): vLLM prefills each row once with its own kernels and batching and writes the
layers asked for; the trainer reads what it wrote, as SpecForge, speculators and ModelOpt do.

The server is the one speculators' data generation starts: speculative method
`extract_hidden_states` with `eagle_aux_hidden_state_layer_ids`, and a KV connector that writes
each request's states to a safetensors file whose path comes back in the reply's
`kv_transfer_params`. The connector is ours (data/vllm_capture_connector.py, copied beside the
server's log and loaded by module path): vLLM's example one writes nothing on a CPU build, and
on a GPU ours is the example one.

vLLM numbers its capture points by the layer they enter: id k is the output of decoder layer
k - 1 (id 0 the embeddings). draftsmith's layer i is the output of layer i, so it asks for
i + 1, and always for the last layer's output, through which the target's own final norm and
head (in this process) give the logits that EAGLE-3's teacher and DSpark read: the engine
returns none over the prompt (a prompt-logprob of every vocabulary row per position is not on
its wire). Measured on SmolLM2-135M in float32: the largest difference from the in-process
forward is 1.1e-6 of the layer's largest value (the last layer; 1.6e-7 in the middle), and
1.2e-4 on logits of about 50, with the same argmax everywhere (tests/test_engine_capture.py).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import nn

from draftsmith.data.server_endpoint import Endpoint, Limits
from draftsmith.errors import DraftsmithError
from draftsmith.fsutil import open_safetensors
from draftsmith.models.target import TargetOutput, decoder_layers, final_norm

IN_PROCESS = "in-process"  # the manifest's `capture` when the target ran in this process
CONNECTOR = "HostHiddenStatesConnector"
CONNECTOR_MODULE = "draftsmith_capture_connector"


def capture_config(engine_ids: list[int], storage: Path) -> tuple[dict, dict]:
    """(speculative config, KV-transfer config) of a capturing server."""
    speculative = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                   "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": engine_ids}}}
    transfer = {"kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": str(storage)}}
    return speculative, transfer


def read_capture(path: str, tokens: torch.Tensor, num_states: int, hidden_size: int) -> torch.Tensor:
    """The states [T, num_states, H] the engine wrote for one row of `tokens` [T]: waits for the
    writer's lock, checks the file against the request, and removes it (it was read whole)."""
    lock = Path(f"{path}.lock")
    if lock.is_file():
        with lock.open() as held:
            fcntl.flock(held, fcntl.LOCK_SH)  # the connector holds it exclusively until written
    remedy = "the engine wrote no whole capture for this row; rerun to resume from the shards written"
    with open_safetensors(path, remedy) as f:
        states, written = f.get_tensor("hidden_states"), f.get_tensor("token_ids")
    if written.shape != tokens.shape or not torch.equal(written.to(tokens.dtype), tokens):
        raise DraftsmithError(f"engine capture {path}: {written.numel()} tokens captured where the request sent "
                              f"{tokens.numel()}" + ("" if written.numel() != tokens.numel() else " (other ids)"))
    if tuple(states.shape) != (tokens.numel(), num_states, hidden_size):
        raise DraftsmithError(f"engine capture {path}: states of shape {list(states.shape)}, where "
                              f"[{tokens.numel()}, {num_states}, {hidden_size}] were asked (other layers or "
                              "another model)")
    lock.unlink(missing_ok=True)
    Path(path).unlink(missing_ok=True)
    return states


class EngineCapture:
    """A vLLM server capturing one target's layers, for `write_feature_cache`'s batches; used
    with `with`. `forward` gives what `frozen_forward` gives in-process: the captured layers at
    the rows' real positions (zero at padding, which every loss masks) and the logits."""

    def __init__(self, target: nn.Module, target_dir: Path, layer_ids: list[int], max_len: int, work_dir: Path,
                 in_flight: int = 16):
        from draftsmith.data.vllm_server import Served, start_vllm

        weight = next(target.parameters())
        self.dtype, self.device, self.width = weight.dtype, weight.device, target.config.hidden_size
        # What turns the captured last layer into logits, as the target does after it.
        self.norm, self.head = final_norm(target), target.get_output_embeddings()
        self.last = len(decoder_layers(target)) - 1
        self.layer_ids = sorted({*layer_ids, self.last})
        self.engine_ids = [i + 1 for i in self.layer_ids]  # vLLM's id k: what enters layer k
        work_dir.mkdir(parents=True, exist_ok=True)
        self.storage = work_dir / "captures"
        shutil.rmtree(self.storage, ignore_errors=True)  # an earlier run's files belong to no request now
        plugin = work_dir / "plugin"
        plugin.mkdir(exist_ok=True)
        shutil.copyfile(Path(__file__).with_name("vllm_capture_connector.py"), plugin / f"{CONNECTOR_MODULE}.py")
        speculative, transfer = capture_config(self.engine_ids, self.storage)
        served = Served(layout="extract_hidden_states", model=str(target_dir),
                        dtype=str(self.dtype).removeprefix("torch."), speculative_config=speculative)
        python_path = os.pathsep.join(filter(None, [str(plugin), os.environ.get("PYTHONPATH")]))
        self.server, self.build = start_vllm(served, work_dir / "vllm.log", max_len + 1,
                                             flags=["--kv-transfer-config", json.dumps(transfer)],
                                             env={"PYTHONPATH": python_path},
                                             doing=f"capturing vLLM layers {self.engine_ids}")
        # No retries: a request sent again after the engine died would only wait for it again.
        self.endpoint = Endpoint(self.server.url, Limits(in_flight=in_flight, retries=0))
        self.pool = ThreadPoolExecutor(max_workers=in_flight)  # a batch's rows in flight at once

    @property
    def label(self) -> str:
        """What the manifest records as the path that wrote the features."""
        return f"vllm {self.build['version']} ({self.build['device']})"

    def _row(self, tokens: torch.Tensor) -> torch.Tensor:
        body = {"model": self.server.model, "prompt": tokens.tolist(), "max_tokens": 1, "temperature": 0.0}
        try:
            reply = self.endpoint.call("/completions", body)
        except DraftsmithError as exc:  # where the engine died, its log says why
            raise self.server.exited(exc, "mid-capture", "rerun to resume from the shards written") or exc from None
        path = (reply.get("kv_transfer_params") or {}).get("hidden_states_path")
        if not path:
            raise DraftsmithError(f"vLLM at {self.server.url} answered without a hidden_states_path: "
                                  "its KV connector is not capturing")
        return read_capture(path, tokens, len(self.engine_ids), self.width)

    def forward(self, batch: dict[str, torch.Tensor]) -> TargetOutput:
        ids, mask = batch["input_ids"].cpu(), batch["attention_mask"].cpu().bool()
        lengths = mask.sum(dim=1)
        if not torch.equal(mask, torch.arange(ids.shape[1])[None, :] < lengths[:, None]):
            raise DraftsmithError("engine capture: rows must be padded on the right (their tokens first)")
        captured = list(self.pool.map(self._row, [row[:n] for row, n in zip(ids, lengths.tolist())]))
        hidden = {i: torch.zeros(*ids.shape, self.width, dtype=self.dtype) for i in self.layer_ids}
        for r, states in enumerate(captured):
            for j, i in enumerate(self.layer_ids):
                hidden[i][r, : states.shape[0]] = states[:, j].to(self.dtype)
        hidden = {i: h.to(self.device) for i, h in hidden.items()}
        with torch.no_grad():
            logits = self.head(self.norm(hidden[self.last]))
        return TargetOutput(logits=logits, hidden=hidden)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.pool.shutdown(cancel_futures=True)
        self.server.stop()
