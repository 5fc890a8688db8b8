"""A vLLM KV connector that writes the hidden states `extract_hidden_states` captured, on any
device vLLM runs on (`draftsmith data cache-hidden --engine vllm`; data/engine_capture.py).

vLLM's own ExampleHiddenStatesConnector copies each finished request's states into pinned host
memory on a CUDA stream and records a CUDA event, so on a CPU build it writes nothing
("pin_memory=True requires a CUDA or other accelerator backend"). This one keeps all of its
bookkeeping (the lock file a reader waits on, the blocks held until the write is done) and
replaces only the copy: on a CPU the states are already in host memory, so it clones them and
writes the file before the request is reported done; on a GPU it defers to the parent.
The file is written under a temporary name and renamed, so a reader never opens half a file.

This file runs inside the engine's own Python (which has no draftsmith): it imports only vLLM,
torch and safetensors, and the engine loads it by module path (`kv_connector_module_path`).
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)


class _Written:
    """Stands where the parent keeps a CUDA event: the copy is done when the file is."""

    def query(self) -> bool:
        return True


class HostHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending) -> None:
        if not self._is_tp_rank_zero:
            return
        if self._kv_cache.is_cuda:  # the parent's stream and pinned copy work there
            return super()._submit_async_write(pending)
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets[None, :] + blocks[:, None] * self._block_size).flatten()
        states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        try:
            partial = f"{pending.filename}.partial"
            save_file({"hidden_states": states, "token_ids": pending.token_ids.clone()}, partial)
            os.replace(partial, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases the reader's wait
        self._req_copy_events[pending.req_id] = _Written()
