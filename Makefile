# The two commands of the README: `make run` and `make test`. Both set up first (idempotent, cached).
PY := .venv/bin/python

.PHONY: setup run test lint soak clean

setup:
	@bash scripts/setup.sh

run: setup
	$(PY) scripts/run_main.py

test: setup lint
	$(PY) -m pytest -q -p no:cacheprovider tests

soak: setup
	$(PY) scripts/soak.py

lint: setup
	.venv/bin/ruff check grace frameworks scripts tests

clean:
	rm -rf .venv out .pytest_cache .ruff_cache
