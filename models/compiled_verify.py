"""`CompiledVerify`: the target's verify forward under torch.compile over a static cache
(target_cache.py), its layer outputs recorded by hooks installed once per model.
"""

from __future__ import annotations

import weakref
from typing import Iterable

import torch
from torch import nn

from draftsmith.errors import DraftsmithError, first_lines
from draftsmith.models.target import TargetOutput, cache_kwarg, check_layer_ids, decoder_layers
from draftsmith.models.target_cache import is_static_cache


class _LayerRecorder:
    """Keeps the outputs of hooked decoder layers while `active`.

    One per model, its hooks installed once and never removed: a compiled graph inlines the
    hooks present when it was traced (dynamo does not guard on hooks), so the per-call hooks
    of `capture_layers` would leave a graph writing into a dead call's dict. Outside a
    compiled verify the hooks return at once.
    """

    def __init__(self):
        self.active = False
        self.outputs: dict[int, torch.Tensor] = {}
        self.hooked: set[int] = set()


_RECORDERS: "weakref.WeakKeyDictionary[nn.Module, _LayerRecorder]" = weakref.WeakKeyDictionary()


def _layer_recorder(model: nn.Module, layer_ids: tuple[int, ...]) -> _LayerRecorder:
    recorder = _RECORDERS.setdefault(model, _LayerRecorder())
    layers = decoder_layers(model)
    for i in layer_ids:
        if i not in recorder.hooked:
            def hook(_module, _inputs, output, i=i):
                if recorder.active:
                    recorder.outputs[i] = output[0] if isinstance(output, tuple) else output
            layers[i].register_forward_hook(hook)
            recorder.hooked.add(i)
    return recorder


def _verify_graph(model, recorder, capture, cache_name, input_ids, position_ids, attention_mask, cache):
    """What torch.compile captures: one target forward, and the recorded layers as outputs."""
    out = model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                use_cache=True, **{cache_name: cache})
    return out.logits, tuple(recorder.outputs.pop(i) for i in capture)


def compile_options(device: torch.device) -> dict:
    """torch.compile settings of the verify forward. On CUDA, 'reduce-overhead' (CUDA graphs:
    they replay fixed shapes at fixed addresses, hence the static cache and padded verify);
    elsewhere inductor's default. One graph (fullgraph) and no dynamic shapes either way."""
    mode = "reduce-overhead" if device.type == "cuda" else None
    return {"mode": mode, "fullgraph": True, "dynamic": False}


class CompiledVerify:
    """`target_forward` for verify passes, under torch.compile, over a static cache.

    Callers keep shapes fixed (the decoder pads every verify to 1 + D rows), so one graph
    serves every step: one for chains (causal mask built inside the graph from the cache's
    write position) and one for trees (the caller's 4D mask). Outputs of a CUDA graph are
    overwritten by its next replay, so they are copied out; elsewhere they are returned as is.
    """

    def __init__(self, model: nn.Module, capture: Iterable[int] = ()):
        self.model = model
        self.capture = tuple(sorted(set(int(i) for i in capture)))
        check_layer_ids(model, self.capture)
        self.recorder = _layer_recorder(model, self.capture)
        device = next(model.parameters()).device
        options = compile_options(device)
        self.cuda_graphs = options.get("mode") == "reduce-overhead"
        self._graph = torch.compile(_verify_graph, **options)

    def __call__(self, input_ids: torch.Tensor, cache, position_ids: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None) -> TargetOutput:
        if not is_static_cache(cache):
            raise DraftsmithError("a compiled verify needs a static target cache")
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()  # the previous step's outputs are done with
        self.recorder.active = True
        try:
            logits, hidden = self._graph(self.model, self.recorder, self.capture, cache_kwarg(self.model),
                                         input_ids, position_ids, attention_mask, cache)
        except torch._dynamo.exc.Unsupported as exc:
            raise DraftsmithError(f"torch.compile cannot capture this target's verify in one graph "
                                  f"({first_lines(exc, 1)}); "
                                  "run without compile") from None
        finally:
            self.recorder.active = False
            self.recorder.outputs.clear()
        if self.cuda_graphs:
            logits, hidden = logits.clone(), tuple(h.clone() for h in hidden)
        return TargetOutput(logits=logits, hidden=dict(zip(self.capture, hidden)), cache=cache)
