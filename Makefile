# Two entry points, both setting up a fresh machine first: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.folio-installed

.PHONY: setup serve run test lint cuda-compile-check clean

setup: $(STAMP)

# torch is installed first, pinned, from the machine's local wheel; everything after is constrained to it, and the
# native extension builds against it (--no-build-isolation), so no step can pull a different torch.
# Each step says what it does before it starts, and pip shows its own progress: a first setup takes minutes.
$(STAMP): pyproject.toml setup.py constraints.txt $(wildcard native/*/*.cpp native/*/*.cu native/*/*.h native/*/*.cuh native/*.py protos/folio/v1/*.proto)
	@echo "==> setup 1/5: the virtual environment $(VENV)"
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "==> setup 2/5: torch 2.13.0 (pinned by constraints.txt)"
	$(BIN)/pip install torch==2.13.0 -c constraints.txt
	@echo "==> setup 3/5: build tools (setuptools, pybind11, ninja, grpcio-tools)"
	$(BIN)/pip install -c constraints.txt setuptools wheel pybind11 ninja grpcio-tools
	@echo "==> setup 4/5: folio and its dependencies (Ray Serve, gRPC, test tools); compiling folio's native"
	@echo "    library against that torch takes several minutes on a small machine"
	MAX_JOBS=$$(nproc) $(BIN)/pip install --no-build-isolation -c constraints.txt -e '.[serve,test]'
	@echo "==> setup 5/5: the gRPC modules (protos/)"
	$(BIN)/python -m folio.proto.compile
	touch $(STAMP)
	@echo "==> setup done"

# The server: a local Ray cluster on loopback, the gRPC ingress and two generator replicas on the demo model.
serve: setup
	$(BIN)/folio serve

# One generation streamed to the terminal, no server.
run: setup
	$(BIN)/folio run

test: setup lint
	$(BIN)/python -m pytest -q

# The committed ruff configuration (pyproject.toml [tool.ruff]) over the whole tree.
lint: setup
	$(BIN)/ruff check .

cuda-compile-check:
	bash native/check_cuda_compiles.sh

clean:
	rm -rf $(VENV) build *.egg-info folio/*.so
