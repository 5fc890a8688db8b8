"""The reference implementations the parity tests run beside ours, loaded by their own
classes: z-lab's `dflash` and SpecForge (tests/test_parity.py), vLLM's `speculators`
(tests/test_speculators_format.py). Pure-Python wheels installed without their pinned
dependencies (`make test` does); without them a test fails, naming the install: a parity
check that skips would pass CI without checking anything."""

import pytest
import torch
from safetensors.torch import load_file

INSTALL = "pip install --no-deps specforge==0.2.0 dflash==0.1.0 (make test does)"
SPECULATORS_INSTALL = "pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0 loguru==0.7.3 (make test does)"


def reference(module: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as error:
        pytest.fail(f"{module} does not import ({error}): {INSTALL}")


def load_reference(cls, out, config):
    """The reference class built from our config.json, our weights loaded strictly."""
    model = cls(config).eval()
    missing, unexpected = model.load_state_dict(load_file(str(out / "model.safetensors")), strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return model


def speculators():
    try:
        import speculators as module
    except ImportError as error:
        pytest.fail(f"speculators does not import ({error}): {SPECULATORS_INSTALL}")
    return module


def reference_model(out):
    """Our folder through speculators' own loading path (eager attention: no compile on CPU)."""
    lib = speculators()
    config = lib.SpeculatorModelConfig.from_pretrained(str(out))
    config.transformer_layer_config._attn_implementation = "eager"
    model = lib.SpeculatorModel.from_pretrained(str(out), config=config).eval()
    stored, own = set(load_file(str(out / "model.safetensors"))), set(model.state_dict())
    optional = set(model._keys_to_ignore_on_load_missing) | set(model._keys_to_ignore_on_save)
    assert not stored - own, sorted(stored - own)  # nothing unexpected
    assert not own - stored - optional, sorted(own - stored - optional)  # nothing missing the verifier cannot fill
    # What the folder leaves to the verifier (the embedding) is filled from it as speculators does
    # (model.py `load_verifier_weights`, which fills a weight it finds NaN): from_pretrained leaves
    # such a weight uninitialized, whatever memory held before.
    # (MTPDraftModel loads them in from_pretrained already, and drops verifier_lm_head on the way.)
    if hasattr(model, "verifier_lm_head"):
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name in own - stored:
                if name in params:
                    params[name].fill_(float("nan"))
        model.load_verifier_weights()
    assert all(not p.isnan().any() for p in model.parameters())
    return model
