# One Makefile, the same checks everywhere. `make test` is what CI runs.
#
# Two installs into one .venv: `make demo` needs only packtool's runtime dependencies; the test
# tools, the data readers the tests open outputs with, torch, torchvision and transformers (the
# trainer-side tests) come with `make test`. pip shows what it downloads and installs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --progress-bar on
RUNTIME := $(VENV)/.runtime
PLOT := $(VENV)/.plot
TESTENV := $(VENV)/.test
SAMPLE := examples/sample
DEMO := build/demo
# The CPU wheels of torch, where a PyTorch wheel index is reachable (the default registry's Linux
# wheel pulls the CUDA libraries): make test TORCH_INDEX=<index URL ending in /whl/cpu>
TORCH_INDEX ?=

.PHONY: demo demo-plot docs test test-slow test-nojit lint schemas bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip

$(RUNTIME): pyproject.toml | $(PY)
	$(PIP) -e .
	touch $@

$(PLOT): $(RUNTIME)
	$(PIP) -e '.[plot]'
	touch $@

# One pip call for everything the tests need (one resolve, one editable build; the runtime
# install is part of it, so it is not run first): packtool with its extras; torch + torchvision
# for the trainer-side tests (the family processors, video and Molmo2, need torchvision, and this
# pair is the one whose wheels lie on the machine: no download); transformers, the model classes
# and processors the hf reader is proven against (tiny random-init models; no weights); torchdata,
# whose StatefulDataLoader the reader's per-worker resume is proven with; qwen-vl-utils, the Qwen
# team's own video preparation, which the Qwen readers' frames, sizes and pixels are checked against.
$(TESTENV): pyproject.toml Makefile | $(PY)
	$(PIP) -e '.[dev,test,plot,zstd,ray,s3,gcs]' torch==2.14.1 torchvision==0.29.1 transformers==5.24.0 torchdata==0.11.0 qwen-vl-utils==0.0.14 $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	touch $@ $(RUNTIME) $(PLOT)

demo: $(RUNTIME)
	rm -rf $(DEMO)
	$(VENV)/bin/packtool tokenize $(SAMPLE)/data.jsonl --media-root $(SAMPLE) -o $(DEMO)/tokenized --quiet
	$(VENV)/bin/packtool pack $(DEMO)/tokenized -o $(DEMO)/packed --max-tokens 8192 --quiet
	$(VENV)/bin/packtool stats $(DEMO)/packed

# the figure in the README: stats of the demo packs, regenerated from a fresh `make demo`
demo-plot: $(PLOT) demo
	$(VENV)/bin/packtool stats $(DEMO)/tokenized $(DEMO)/packed --plot docs/demo-stats.png > /dev/null

# every console block of the README (and the figure) regenerated from the sample data
docs: $(PLOT)
	$(PY) docs/readme.py --write

# the suite less the tests marked slow (real CLI processes killed and resumed, Ray clusters, the
# S3 and GCS servers, compiled flex-attention kernels, the README's every block): those are
# `make test-slow`; CI runs both
test: $(TESTENV)
	$(PY) -m pytest -q -m "not slow"

test-slow: $(TESTENV)
	$(PY) -m pytest -q -m slow

test-nojit: $(TESTENV)
	NUMBA_DISABLE_JIT=1 $(PY) -m pytest -q -m "not slow"

lint: $(TESTENV)
	$(VENV)/bin/ruff check packtool tests bench

schemas: $(RUNTIME)
	$(PY) -m packtool.schema schemas

bench: $(TESTENV)
	$(PY) -m bench $(BENCH)

clean:
	rm -rf $(VENV) build .pytest_cache
