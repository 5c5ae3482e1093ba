# headroom: every target installs what it needs: this checkout's .venv, exactly as uv.lock says
# (packages hard-linked from the shared cache under ~/.cache/headroom).
SHELL := /bin/bash
.DEFAULT_GOAL := help
VENV := .venv
PY := $(VENV)/bin/python
HEADROOM_CACHE ?= $(HOME)/.cache/headroom
CACHE ?= $(HEADROOM_CACHE)
export HEADROOM_CACHE := $(CACHE)
export PYTHONUNBUFFERED := 1
# Loopback never goes through a proxy: curl and urllib would send 127.0.0.1 to $$http_proxy.
comma := ,
LOOPBACK := 127.0.0.1,localhost,::1
export no_proxy := $(if $(no_proxy),$(no_proxy)$(comma))$(LOOPBACK)
export NO_PROXY := $(if $(NO_PROXY),$(NO_PROXY)$(comma))$(LOOPBACK)

.PHONY: help venv lock demo test lint unit bench crd tools e2e image
help:
	@echo "make demo   run the planner, the CPU engine with the tiny model, the sidecar and the autoscaler"
	@echo "make test   lint, type-check and run every test (builds the test control plane on first run)"
	@echo "make bench  run the benchmarks under bench/ and print their tables"
	@echo "make e2e    end-to-end scenarios on the real control plane"
	@echo "make image  build the headroom and headroom-engine images here (no registry), run and export them"
	@echo "make lock   re-resolve uv.lock after editing the ranges in pyproject.toml"
	@echo "make venv   only install .venv from uv.lock (the headroom command is .venv/bin/headroom)"
	@echo "make crd    regenerate the CRD from the pydantic models (and the chart's copy)"
	@echo "make cluster-up / cluster-down   keep a test control plane running for manual work"

venv:
	@scripts/venv.sh

# The only step that resolves versions; everything else installs the lock as it is.
lock:
	@UV_CACHE_DIR=$(CACHE)/uv UV_PYTHON_DOWNLOADS=never "$$(scripts/uv.sh)" lock --python python3.11

demo: venv
	@$(PY) scripts/demo.py

lint: venv
	$(VENV)/bin/ruff check contract engine sidecar operator tests bench e2e scripts
	$(VENV)/bin/ruff format --check contract engine sidecar operator tests bench e2e scripts
	$(VENV)/bin/mypy contract/headroom engine/headroom sidecar/headroom operator/headroom bench scripts/demo.py

# Debian packages the tests use (Prometheus and promtool, etcd); idempotent and quiet when present.
tools:
	@scripts/tools.sh

unit: venv tools
	$(PY) -m pytest -q

# CI runs everything: unit and integration tests (tests/), then the e2e scenarios (e2e/).
test: lint unit e2e

# Every bench runs even after a MISS; the target fails at the end naming those that missed.
# Exit 77 is a bench that needs a GPU this machine lacks: reported, not a failure.
bench: venv
	@failed=""; for b in $(basename $(notdir $(filter-out bench/__init__.py bench/verdicts.py,$(wildcard bench/*.py)))); do \
		echo "== bench.$$b"; $(PY) -m bench.$$b; rc=$$?; \
		if [ $$rc = 77 ]; then echo "(skipped: bench.$$b needs a GPU)"; \
		elif [ $$rc != 0 ]; then failed="$$failed $$b"; fi; done; \
	if [ -n "$$failed" ]; then echo "MISS in:$$failed" >&2; exit 1; fi

# Both images, built with no registry (mmdebstrap, buildah and podman from Debian: see
# scripts/image.sh), run (the engine answers /health) and exported as OCI archives under
# $(CACHE)/images. `make test` builds and runs the small one (tests/test_image.py).
image: venv
	@scripts/image.sh all

# The chart ships its own copy (Helm installs charts/<name>/crds/); a test keeps them identical.
crd: venv
	$(VENV)/bin/headroom crd > crds/inferencedeployment.yaml
	cp crds/inferencedeployment.yaml charts/headroom/crds/inferencedeployment.yaml

-include e2e/cluster/cluster.mk
-include e2e/e2e.mk
