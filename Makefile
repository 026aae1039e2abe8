# Everything a fresh clone needs: `make demo` and `make test` install what they use first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.installed-bench
EXTRAS := obstore,test,stateful,devserver,image,zstd,docs,parquet
COMPOSE := docker compose -f docker/docker-compose.yml --env-file docker/minio.env

.PHONY: install install-bench lint docs mutation test test-all unit-test integration-test demo bench bench-listing minio-up minio-down clean

install: $(STAMP)

# torch first and pinned: the CPU wheel this machine carries; an unpinned torch pulls a
# multi-GB CUDA build. The rest is pinned through constraints.txt (aioboto3 and botocore
# pin each other tightly; unpinned installs have backtracked to 2018 releases).
# (Not --no-compile, though it saves ~17 s here: where PYTHONDONTWRITEBYTECODE is set, as on
# these machines, every process, each spawned worker too, would compile torch again: the
# suite took 1.5 minutes longer.)
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[$(EXTRAS)]"
	touch $@

install-bench: $(BENCH_STAMP)

$(BENCH_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[$(EXTRAS),bench]"
	touch $@

# ruff and mypy, configured in pyproject.toml; `make test` runs both too (mypy beside the suite).
lint: install
	$(BIN)/ruff check loader tests integration bench conftest.py
	$(BIN)/mypy

# The documentation site (mkdocs + mkdocstrings) in site/; `make test` builds it strictly too
# (tests/test_docs.py) and runs every example of the README and the guides
# (integration/test_docs_examples.py). `$(BIN)/mkdocs serve` to read it while writing.
docs: install
	$(BIN)/mkdocs build --strict

# Three processes (pytest-xdist) on two cores: much of the suite waits on servers, subprocesses
# and spawned workers, which other processes overlap (on a fresh clone, 2 took 10 min 24 s, 3 took
# 8 min 20 s). Each worker starts its own S3 server (tests restart it). Whole files go to one worker, so a module-scoped fixture (data uploaded once, a wheel built
# once) is built once; in collection order, so the small files at the end even out the finish.
# (--dist loadgroup would split finer, but pytest-xdist 3.8 ignores its groups under pytest 9.2.)
TEST_WORKERS ?= 3
PARALLEL := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# Bytecode is written while the suite runs, even where PYTHONDONTWRITEBYTECODE is set (as on
# these machines): each of the hundreds of processes the suite starts (xdist workers, spawned
# DataLoader workers and ranks, CLI runs) would otherwise compile loader and the tests again
# (collecting the suite: 9 s of CPU a worker without bytecode, 4 s with it).
PYTEST := PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest

# mypy runs beside the suite rather than before it (15-25 s of one core while the suite starts
# its servers); either failing fails the target.
test: install
	$(BIN)/ruff check loader tests integration bench conftest.py
	$(BIN)/mypy & mypy=$$!; \
	$(PYTEST) tests integration -q $(PARALLEL); tests=$$?; \
	wait $$mypy || { echo "mypy failed (above)"; exit 1; }; exit $$tests

# Everything, the slow-marked tests too (minutes more: bench-listing's 200,000 keys among them).
test-all: lint
	$(PYTEST) tests integration -q $(PARALLEL) -m "slow or not slow"

# Mutation testing of the pure modules (pyproject.toml [tool.mutmut]); slow, not part of `make test`.
mutation: install
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[$(EXTRAS),mutation]"
	$(BIN)/mutmut run --max-children 2
	$(BIN)/mutmut results

unit-test: install
	$(BIN)/python -m pytest tests -q

integration-test: install
	$(BIN)/python -m pytest integration -q

demo: install
	$(BIN)/python -m loader demo

bench: install-bench
	$(BIN)/python -m bench.run

# 200,000 keys listed through 5 % resets and 5 % SlowDowns, both backends (several minutes);
# LOADER_LISTING_KEYS=... for another count
bench-listing: install
	$(BIN)/python -m pytest integration/test_listing_s3.py -m slow -q -s

# A local MinIO on 127.0.0.1:9000 (console :9001) with a bucket `train` (needs a Docker engine).
minio-up:
	$(COMPOSE) up -d --wait minio
	$(COMPOSE) run --rm create-bucket
	@echo "MinIO is up. Point the tests at it with:  set -a; . docker/minio.env; set +a; make integration-test"

# Stop it; `$(COMPOSE) down -v` also deletes its data volume.
minio-down:
	$(COMPOSE) down

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis .mypy_cache .ruff_cache mutants
