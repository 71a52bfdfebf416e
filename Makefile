# Two entry points, both setting up a fresh machine first: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.folio-installed

.PHONY: setup serve run test lint cuda-compile-check clean

setup: $(STAMP)

# torch is installed first, pinned, from the machine's local wheel; everything after is constrained to it, and the
# native extension builds against it (--no-build-isolation), so no step can pull a different torch.
$(STAMP): pyproject.toml setup.py constraints.txt $(wildcard native/*/*.cpp native/*/*.cu native/*/*.h native/*/*.cuh native/*.py protos/folio/v1/*.proto)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0 -c constraints.txt
	$(BIN)/pip install -q -c constraints.txt setuptools wheel pybind11 ninja grpcio-tools
	MAX_JOBS=$$(nproc) $(BIN)/pip install -q --no-build-isolation -c constraints.txt -e '.[serve,test]'
	$(BIN)/python -m folio.proto.compile
	touch $(STAMP)

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
