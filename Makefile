# Two entry points on a fresh machine:
#   make run   — create .venv, install, build engines/tiny from the embedded recipe, serve it
#   make test  — create .venv, install with the test extras, run the test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
TORCH  := $(VENV)/.torch
STAMP  := $(VENV)/.installed
EXTRAS := $(VENV)/.installed-extras
HOST   ?= 127.0.0.1
PORT   ?= 8000

.PHONY: install run build serve test ci-engines clean

# torch==2.13.0 first: it is a CPU build on these machines; a bare `torch` requirement would
# pull a multi-GB CUDA build. The project's own range (torch>=2.8) is then already satisfied.
$(TORCH):
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	touch $(TORCH)

# `make run` needs the project alone; tests and CI engines add the test, kernel and
# TensorRT-RTX extras.
$(STAMP): pyproject.toml $(TORCH)
	$(BIN)/pip install -q -e .
	touch $(STAMP)

$(EXTRAS): pyproject.toml $(TORCH)
	$(BIN)/pip install -q -e '.[test,kernels,trt]'
	touch $(STAMP) $(EXTRAS)

install: $(STAMP)

engines/tiny/config.json: $(STAMP) recipes/tiny.toml $(wildcard recipes/tiny/*/*)
	$(BIN)/metrale build

build: engines/tiny/config.json

serve: build
	@echo
	@echo "metrale serves engines/tiny on http://$(HOST):$(PORT); try:"
	@echo "  curl http://$(HOST):$(PORT)/v1/completions -H 'Content-Type: application/json' \\"
	@echo "       -d '{\"model\": \"tiny\", \"prompt\": \"def main(\", \"max_tokens\": 32, \"temperature\": 0}'"
	@echo
	$(BIN)/metrale serve --engine-dir engines/tiny --host $(HOST) --port $(PORT) $(SERVE_FLAGS)

run: serve

test: $(EXTRAS)
	$(BIN)/python -m pytest -q

# CI engine artifacts: TensorRT-RTX engines for SM89 and SM120 in every drafter tier, built
# with no GPU under engines/ci/<tier>, then checked (manifest, checksums, plugin layers).
ci-engines: $(EXTRAS)
	$(BIN)/python .ci/check_engines.py

clean:
	rm -rf engines/tiny $(VENV)
