"""Golden loss curves: the first steps of every tiny recipe reproduce the losses checked
in under tests/golden/, so a change that moves training (a loss term, a mask, an init, the
data pipeline) shows up here even when every behavioural test still passes.

A deliberate change regenerates them: `python scripts/update_golden.py`, and the commit
says why the curves moved. The runs take about 15 seconds together (tests/golden_runs.py).
"""

import json

import numpy as np
import pytest

import golden_runs

# Tolerance on each loss, relative. The same process gives the same curve bit for bit, at
# 1 or 2 threads; the script and this test already differ in the last bits (~1e-7), and
# another torch, MKL or oneDNN build reorders float32 sums, moving each op's result in its
# last bits (~6e-8 relative). Measured: scaling every trainable weight
# by (1 + 1e-5 * noise), over a hundred times that, moves no loss of the 6 steps by more
# than 2e-5. A real change moves them far more: MTP's lambda 0.3 -> 0.303 (1%) moves every
# MTP loss by 2.3e-3, DSpark's ce_weight 0.1 -> 0.101 its losses by 4e-3 to 6e-3. So 1e-3
# sits fifty times above the noise and below a 1% change of a loss weight.
RTOL = 1e-3


@pytest.fixture(scope="module")
def curves(tmp_path_factory, monkeypatch_module):
    work = tmp_path_factory.mktemp("golden")
    monkeypatch_module.setenv("DRAFTSMITH_CACHE", str(work / "cache"))
    return golden_runs.run_all(work)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.mark.parametrize("method", golden_runs.METHODS)
def test_the_first_steps_reproduce_the_golden_losses(curves, method):
    golden = json.loads(golden_runs.golden_file(method).read_text())
    redo = "run `python scripts/update_golden.py` if the change is meant to move training"
    assert golden["overrides"] == golden_runs.record(method, {})["overrides"], f"the settings changed: {redo}"
    got = curves[method]
    assert len(got["train/loss"]) == golden["steps"] == golden_runs.STEPS and len(got["val/loss"]) == 1
    for key in ("train/loss", "val/loss"):
        assert np.allclose(got[key], golden[key], rtol=RTOL, atol=0), (
            f"{method} {key}: {got[key]} != golden {golden[key]} (made with {golden['made_with']}); {redo}")
