# The two commands of the README: `make run` and `make test`. Both set up first (idempotent, cached).
PY := .venv/bin/python

.PHONY: setup run test test-slow test-cuda lint soak compare quality bench docs clean

setup:
	@bash scripts/setup.sh

run: setup
	$(PY) -m scripts.run_main

# The suite but its long runs (under 15 minutes on 2 cores); test-slow runs those (tests marked
# slow: the convergence matrix, the emulated cluster's comparisons...). CI runs both.
test: setup lint
	$(PY) -m pytest -q -p no:cacheprovider tests --ignore=tests/cuda -m "not slow"

test-slow: setup
	$(PY) -m pytest -q -p no:cacheprovider tests --ignore=tests/cuda -m slow

# The CUDA path (tests/cuda), on a machine with a GPU and PyTorch built for it; no Horovod needed.
test-cuda:
	python3 -m pytest -q -p no:cacheprovider tests/cuda

soak: setup
	$(PY) -m scripts.tools.soak

# The side-by-side matrix (docs/results.md); as root it runs on an emulated cluster with shaped links.
compare: setup
	$(PY) -m scripts.compare --compressors fp32,hvd-fp16,topk:ratio=0.01,qsgd,efsignsgd,powersgd:rank=2 \
		--rates 100mbit,1gbit,unshaped --workers 2,4

# Every compressor trained to convergence against uncompressed training (docs/quality.md): hours.
# Then mnist through PyTorch DDP: grace's hook beside DDP without a hook and PyTorch's own hooks;
# then the CNN's time to accuracy on 2 emulated hosts at 1 Gbit/s (as root; else localhost).
quality: setup
	$(PY) -m scripts.quality --out out/quality
	$(PY) -m scripts.quality --cases mnist-sgd,mnist-adam --frameworks torch --engines ddp \
		--compressors fp32,torch-fp16,torch-powersgd-r1,torch-powersgd-r2,$$($(PY) -c \
		"import grace; print(','.join(grace.available()))") --out out/quality-ddp
	$(PY) -m scripts.time_to_accuracy --out out/time-to-accuracy

# Compression cost against a plain copy, PowerSGD against PyTorch's hooks, the wrapper's overhead.
bench: setup
	mkdir -p out
	bash -o pipefail -c '$(PY) -m scripts.tools.bench_compressors --powersgd --overhead --json out/bench.json --plot out/bench.png | tee out/bench.md'

# Every generated table of README.md and docs/ made again from its run files (scripts/doc_tables.py).
docs: setup
	$(PY) -m scripts.doc_tables

lint: setup
	.venv/bin/ruff check grace frameworks scripts tests

clean:
	rm -rf .venv out .pytest_cache .ruff_cache
