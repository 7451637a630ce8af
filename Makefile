# One Makefile, the same checks everywhere. `make test` is what CI runs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SAMPLE := examples/sample
DEMO := build/demo

.PHONY: demo demo-plot test test-nojit lint schemas bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,plot,zstd,ray]'
	# torch + torchvision for the trainer-side tests: the family processors (video, Molmo2) need
	# torchvision, and this pair is the one whose wheels lie on the machine (no download)
	$(PY) -m pip install -q torch==2.14.1 torchvision==0.29.1
	# the model classes and processors the hf reader is proven against (tiny random-init models; no weights)
	$(PY) -m pip install -q transformers==5.24.0
	touch $(STAMP)

demo: $(STAMP)
	rm -rf $(DEMO)
	$(VENV)/bin/packtool tokenize $(SAMPLE)/data.jsonl --media-root $(SAMPLE) -o $(DEMO)/tokenized --quiet
	$(VENV)/bin/packtool pack $(DEMO)/tokenized -o $(DEMO)/packed --max-tokens 8192 --quiet
	$(VENV)/bin/packtool stats $(DEMO)/packed

# the figure in the README: stats of the demo packs, regenerated from a fresh `make demo`
demo-plot: demo
	$(VENV)/bin/packtool stats $(DEMO)/tokenized $(DEMO)/packed --plot docs/demo-stats.png > /dev/null

test: $(STAMP)
	$(PY) -m pytest -q

test-nojit: $(STAMP)
	NUMBA_DISABLE_JIT=1 $(PY) -m pytest -q -m "not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check packtool tests bench

schemas: $(STAMP)
	$(PY) -m packtool.schema schemas

bench: $(STAMP)
	$(PY) -m bench $(BENCH)

clean:
	rm -rf $(VENV) build .pytest_cache
