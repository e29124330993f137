# Two commands a newcomer needs: `make run` and `make test`. Both install into .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: install run test bench clean

install: $(STAMP)

# Keep a torch the user already has (a CUDA build, say). Without CUDA, take the CPU build
# torch==2.13.0 before anything else can pull a multi-GB CUDA build in as a dependency.
$(STAMP): setup.cfg pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@if $(BIN)/python -c "import torch" 2>/dev/null; then \
		echo "keeping installed torch $$($(BIN)/python -c 'import torch; print(torch.__version__)')"; \
	elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(BIN)/pip install torch; \
	else \
		$(BIN)/pip install $$(test -d /opt/wheels && echo --find-links /opt/wheels) torch==2.13.0; \
	fi
	$(BIN)/pip install -e '.[dev,serve]'
	@# the CPU kernels are compiled on first use; build them now so the first run does not wait
	$(BIN)/python -c "from tpengine.kernels.cpu.paged_decode_attention import load; load()" \
		|| echo "could not build the CPU attention kernel: the CPU will use the slower torch backend"
	$(BIN)/python -c "from tpengine.kernels.cpu.fused_ops import load; load()" \
		|| echo "could not build the fused CPU ops: the CPU layers will run their torch code"
	@# bfloat16 linears on AVX512-BF16 CPUs only: elsewhere bfloat16 runs on oneDNN or as float32
	$(BIN)/python -c "from tpengine.kernels.cpu.bf16_linear import available; available()"
	$(BIN)/python -c "from tpengine.kernels.cpu.sampling import available; available()"
	$(BIN)/python -c "from tpengine.kernels.cpu.token_bitmask import available; available()"
	$(BIN)/python -c "from tpengine.kernels.cpu.quant_linear import available; available()"
	$(BIN)/python -c "from tpengine.kernels.cpu.op_replay import available; available()"
	$(BIN)/python -c "from tpengine.kernels.cpu.shm_allreduce import load; load()" \
		|| echo "could not build the CPU all-reduce kernel: CPU ranks on one host will all-reduce through gloo"
	touch $(STAMP)

run: install
	$(BIN)/tpengine generate "Hello, tpengine" "Tensor parallelism splits"

test: install
	$(BIN)/python -m pytest -q $(PYTEST_ARGS) tests

bench: install
	$(BIN)/python scripts/bench_scheduler.py
	$(BIN)/python scripts/bench_control_plane.py
	$(BIN)/python scripts/bench_cpu_kernels.py
	$(BIN)/python scripts/bench.py

clean:
	rm -rf $(VENV) build *.egg-info
