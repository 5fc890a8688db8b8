"""What the engine path of the feature cache (data/engine_capture.py) refuses, in one line each,
without an engine: a capture file missing or cut short, one of other tokens or length, one of
other layers; an unknown engine, or none installed, before anything is written; an engine that
exited under a request, by the reason its log gives."""

import fcntl
import os
import threading
import time

import pytest
import torch
from safetensors.torch import save_file

from draftsmith.cli import main
from draftsmith.data.engine_capture import capture_config, read_capture
from draftsmith.errors import DraftsmithError

TOKENS = torch.tensor([5, 6, 7, 8])


def written(tmp_path, tokens=TOKENS, states=None):
    path = tmp_path / "req.safetensors"
    states = torch.randn(len(tokens), 2, 16) if states is None else states
    save_file({"hidden_states": states, "token_ids": tokens}, str(path))
    return str(path), states


def test_a_whole_capture_is_read_and_removed(tmp_path):
    path, states = written(tmp_path)
    assert torch.equal(read_capture(path, TOKENS, 2, 16), states)
    assert not os.path.exists(path)


def test_the_reader_waits_for_the_writers_lock(tmp_path):
    path = tmp_path / "req.safetensors"
    fd = os.open(f"{path}.lock", os.O_CREAT | os.O_WRONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as the connector holds it from scheduling until written

    def write_late():
        time.sleep(0.3)
        written(tmp_path)
        os.close(fd)

    threading.Thread(target=write_late).start()
    assert read_capture(str(path), TOKENS, 2, 16).shape == (4, 2, 16)


def test_a_missing_capture_is_one_line(tmp_path):
    with pytest.raises(DraftsmithError, match="not found; the engine wrote no whole capture"):
        read_capture(str(tmp_path / "gone.safetensors"), TOKENS, 2, 16)


def test_a_truncated_capture_is_one_line_and_kept_for_a_look(tmp_path):
    path, _ = written(tmp_path)
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])
    with pytest.raises(DraftsmithError, match="truncated or damaged"):
        read_capture(path, TOKENS, 2, 16)


@pytest.mark.parametrize("tokens, says", [(torch.tensor([5, 6, 7]), "3 tokens captured where the request sent 4"),
                                          (torch.tensor([5, 6, 7, 9]), "other ids")])
def test_a_capture_of_another_request_is_refused(tmp_path, tokens, says):
    path, _ = written(tmp_path, tokens=tokens)
    with pytest.raises(DraftsmithError, match=says):
        read_capture(path, TOKENS, 2, 16)


def test_a_capture_of_other_layers_is_refused(tmp_path):
    path, _ = written(tmp_path, states=torch.randn(4, 3, 16))
    with pytest.raises(DraftsmithError, match=r"states of shape \[4, 3, 16\], where \[4, 2, 16\] were asked"):
        read_capture(path, TOKENS, 2, 16)


def test_the_server_asks_for_each_layer_by_vllms_number_and_our_connector(tmp_path):
    speculative, transfer = capture_config([1, 15, 30], tmp_path)
    assert speculative["method"] == "extract_hidden_states" and speculative["num_speculative_tokens"] == 1
    assert speculative["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 15, 30]
    assert transfer["kv_connector_module_path"] == "draftsmith_capture_connector"
    assert transfer["kv_connector_extra_config"]["shared_storage_path"] == str(tmp_path)


def test_an_unknown_engine_is_refused_before_anything_is_written(tmp_path, capsys):
    assert main(["data", "cache-hidden", "--out", str(tmp_path / "c"), "--engine", "sglang"]) == 2
    assert "data cache-hidden: --engine must be one of vllm, got 'sglang'" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


def test_a_server_that_exited_under_a_request_is_one_line_with_its_logs_reason(tmp_path):
    """The client sees a refused connection; the line says why the engine ended, from its log."""
    import subprocess
    import sys

    from draftsmith.data.vllm_server import VllmServer

    server = VllmServer.__new__(VllmServer)  # its state after a start, without starting vLLM
    server.log = tmp_path / "vllm.log"
    server.log.write_text("(Worker pid=1) ERROR 12-08 [x.py:1] RuntimeError: CPU Generator does not use offset\n")
    server.process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert server.exited(ConnectionRefusedError("refused"), "mid-capture", "rerun") is None  # still running
    finally:
        server.process.kill()
        server.process.wait()
    line = str(server.exited(ConnectionRefusedError("refused"), "mid-capture", "rerun to resume"))
    assert line == (f"vLLM exited mid-capture: RuntimeError: CPU Generator does not use offset (log: {server.log}); "
                    "rerun to resume")


def test_a_cpu_engine_keeps_prefills_whole_in_a_step_of_at_least_its_default():
    from draftsmith.data.vllm_server import whole_prefills

    assert whole_prefills({"device": "cpu"}, 8192) == ["--no-enable-chunked-prefill", "--max-num-batched-tokens", "8192"]
    assert whole_prefills({"device": "cpu"}, 385) == ["--no-enable-chunked-prefill", "--max-num-batched-tokens", "2048"]
    assert whole_prefills({"device": "cuda"}, 8192) == []  # a GPU generator rewinds
