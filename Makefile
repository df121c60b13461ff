# The README's two commands: `make serve` and `make test` (`make demo` shows failover). Both create .venv when missing.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DEPS_STAMP := $(VENV)/.eaas-deps
# Installed as a strict editable link tree (build/__editable__.eaas-*): mypy cannot follow
# setuptools' default editable install (an import hook), but it reads the link tree.
EDITABLE := --config-settings editable_mode=strict

.PHONY: help install serve demo test lint typecheck unit e2e crds clean image tools-venv
help: ## this list (every target, from the `## ` note on its line)
	@awk 'BEGIN {FS = ":[^#]*## "} /^[a-zA-Z0-9_-]+:[^#]*## / {printf "make %-14s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

# Heavy dependencies (torch is several GB) are installed once per .venv.
$(DEPS_STAMP): pyproject.toml setup.py
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q -e '.[test,nixl]' $(EDITABLE)
	@touch $@

# Cheap re-link so new modules appear in the editable tree.
install: $(DEPS_STAMP) ## create .venv with every dependency (once), re-link the editable tree
	@$(PY) -m pip install -q --no-deps --no-build-isolation -e . $(EDITABLE) > $(VENV)/.eaas-install.log 2>&1 \
		|| { cat $(VENV)/.eaas-install.log; exit 1; }

serve: install ## serve a tiny random model (OpenAI API on :8000) from a local EaaS cluster
	$(VENV)/bin/eaas serve --preset mixtral/tiny --servers 2 --port 8000

demo: install ## a local EaaS cluster on a tiny random model; kills an expert server mid-run (failover)
	$(VENV)/bin/eaas local --preset tiny --servers 4 --replication 2 --prompts 8 --max-new-tokens 24 --kill-server-after 8

lint: install ## ruff check and ruff format --check
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: install ## mypy of the eaas package and of e2e/
	MYPYPATH=$$(ls -d build/__editable__.eaas-*) $(VENV)/bin/mypy -p eaas
	MYPYPATH=$$(ls -d build/__editable__.eaas-*) $(VENV)/bin/mypy e2e

unit: install ## the tests that need no Kubernetes control plane
	$(PY) -m pytest -m "not e2e"

e2e: install k8s-bins ## the tests on the real Kubernetes control plane
	$(PY) -m pytest -m e2e

# GuideLLM, lm-evaluation-harness and AIPerf (tests/tools/), pinned in tests/tools/requirements.txt:
# a venv of their own, built once into ~/.cache/eaas, that reuses the project's .venv packages (torch).
tools-venv: install ## the venv of the serving tools the tests run (GuideLLM, lm-eval, AIPerf), once into ~/.cache/eaas
	@bash tests/tools/build-venv.sh >/dev/null

test: install k8s-bins tools-venv ## lint, typecheck and the whole test suite (what CI runs)
	$(MAKE) --no-print-directory lint typecheck
	$(PY) -m pytest

crds: install ## regenerate crds/, the chart's CRDs and docs/crd-reference.md from the models
	$(PY) -m eaas.operator.crdgen --out crds --chart charts/eaas/crds --docs docs/crd-reference.md

# Opt-in (heavy; not part of `make test`): the OCI image from Debian's archive with mmdebstrap and umoci,
# checked with runc as its user 65532 (image/build.sh; docs/install.md, "Container image").
VARIANT ?= cuda
image: ## opt-in, as root: build the OCI image without Docker (VARIANT=cuda|cpu), run it, size it
	image/build.sh $(VARIANT)

clean: ## remove build and tool caches of the checkout
	rm -rf build *.egg-info .pytest_cache .mypy_cache .ruff_cache

# Kubernetes control-plane binaries and cluster-up/cluster-down (e2e/k8s.mk).
include e2e/k8s.mk
