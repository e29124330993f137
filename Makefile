# Two commands a newcomer needs: `make run` and `make test`. Both install into .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: install build-kernels lock run test bench clean

install: $(STAMP)

# The lock: every package's version the suite last passed with (`make lock` moves it to the newest releases).
LOCK := constraints.txt
UPGRADE_VENV := .venv-upgrade

# Keep a torch the user already has (a CUDA build, say): then torch and triton are left out of the lock, as a CUDA
# torch pins its own triton. Without CUDA, take the CPU build torch==2.13.0 before anything else can pull a
# multi-GB CUDA build in as a dependency.
$(STAMP): setup.cfg pyproject.toml $(LOCK)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@if $(BIN)/python -c "import torch" 2>/dev/null; then \
		echo "keeping installed torch $$($(BIN)/python -c 'import torch; print(torch.__version__)')"; \
		grep -vE '^(torch|triton)==' $(LOCK) > $(VENV)/constraints.txt; \
	elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(BIN)/pip install torch; \
		grep -vE '^(torch|triton)==' $(LOCK) > $(VENV)/constraints.txt; \
	else \
		$(BIN)/pip install -c $(LOCK) $$(test -d /opt/wheels && echo --find-links /opt/wheels) torch==2.13.0; \
		cp $(LOCK) $(VENV)/constraints.txt; \
	fi
	@# the build backend comes from the lock too: the editable install builds without isolation
	$(BIN)/pip install -c $(VENV)/constraints.txt setuptools
	$(BIN)/pip install --no-build-isolation -c $(VENV)/constraints.txt -e '.[dev,serve]'
	$(MAKE) --no-print-directory build-kernels BIN=$(BIN)
	touch $(STAMP)

# the CPU kernels are compiled on first use; build them now so the first run does not wait
build-kernels:
	$(BIN)/python -c "from tpengine.kernels.cpu.paged_decode_attention import load; load()" \
		|| echo "could not build the CPU attention kernel: the CPU will use the slower torch backend"
	$(BIN)/python -c "from tpengine.kernels.cpu.prefill_attention import available; available()"
	$(BIN)/python -c "from tpengine.kernels.cpu.fused_ops import load; load()" \
		|| echo "could not build the fused CPU ops: the CPU layers will run their torch code"
	@# bfloat16 linears on AVX512-BF16 CPUs only: elsewhere bfloat16 runs on oneDNN or as float32
	$(BIN)/python -c "from tpengine.kernels.cpu.bf16_linear import available; available()"
	$(BIN)/python -c "from tpengine.kernels.cpu.sampling import available; available()"
	$(BIN)/python -c "from tpengine.kernels.cpu.token_bitmask import available; available()"
	$(BIN)/python -c "from tpengine.kernels.cpu.quant_linear import available; available()"
	$(BIN)/python -c "from tpengine.kernels.cpu.op_replay import available; available()"
	$(BIN)/python -c "from tpengine.kernels.cpu.lora import available; available()"
	$(BIN)/python -c "from tpengine.kernels.cpu.shm_allreduce import load; load()" \
		|| echo "could not build the CPU all-reduce kernel: CPU ranks on one host will all-reduce through gloo"

# Move the lock to the newest releases: a fresh venv without the lock, the whole suite on it, and only if it passes,
# its versions written to the lock (local version labels such as +cpu dropped, so a CUDA torch matches too).
lock:
	rm -rf $(UPGRADE_VENV)
	$(PYTHON) -m venv $(UPGRADE_VENV)
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(UPGRADE_VENV)/bin/pip install --upgrade torch; \
	else \
		$(UPGRADE_VENV)/bin/pip install --upgrade $$(test -d /opt/wheels && echo --find-links /opt/wheels) torch==2.13.0; \
	fi
	$(UPGRADE_VENV)/bin/pip install --upgrade pip setuptools
	$(UPGRADE_VENV)/bin/pip install --upgrade --no-build-isolation -e '.[dev,serve]'
	$(MAKE) --no-print-directory build-kernels BIN=$(UPGRADE_VENV)/bin
	NO_MKDOCS_2_WARNING=1 $(UPGRADE_VENV)/bin/mkdocs build --strict --site-dir build/site
	$(UPGRADE_VENV)/bin/python -m pytest -q $(PYTEST_ARGS) tests
	$(UPGRADE_VENV)/bin/pip freeze --all --exclude-editable | grep -vE '^(pip|tpengine)==' \
		| sed -E 's/\+[A-Za-z0-9.]+$$//' | sort -f > $(LOCK)
	@echo "$(LOCK) now holds the versions the suite passed with; make clean && make test installs from it"

run: install
	$(BIN)/tpengine generate "Hello, tpengine" "Tensor parallelism splits"

# the documentation site first (mkdocs.yml, into build/site): --strict fails on a broken link or anchor, or on a
# page under docs/ left out of the nav
test: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir build/site
	$(BIN)/python -m pytest -q $(PYTEST_ARGS) tests

bench: install
	$(BIN)/python benchmarks/bench_scheduler.py
	$(BIN)/python benchmarks/bench_control_plane.py
	$(BIN)/python benchmarks/bench_cpu_kernels.py
	$(BIN)/python benchmarks/bench.py

clean:
	rm -rf $(VENV) $(UPGRADE_VENV) build *.egg-info
