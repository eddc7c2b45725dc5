# Two entry points do all set-up: `make demo` and `make test`. Both build .venv from requirements.txt
# when it is missing or when requirements.txt changed (the stamp file), and never touch a current one.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.requirements.stamp
BIN := $(VENV)/bin

.PHONY: venv demo test test-fast lint bench extras clean-venv

venv: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade "pip>=24"
	grep -v '^mosaicml==' requirements.txt > $(VENV)/requirements.deps.txt
	$(BIN)/python -m pip install -q -r $(VENV)/requirements.deps.txt
	$(BIN)/python -m pip install -q --no-deps $$(grep -o '^mosaicml==[^ ]*' requirements.txt)
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	@cp requirements.txt $(STAMP)

demo: $(STAMP)
	$(BIN)/grape-stream demo $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(ARGS)

# The fast unit tests only (no servers, processes, Spark or training runs): about 30 s.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not integration" $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check grape_stream tests bench scripts
	$(BIN)/mypy

# Every bench script in turn (ARGS=--quick for a smoke run that leaves bench/results/ alone).
bench: $(STAMP)
	$(BIN)/python bench/run_all.py $(ARGS)

# Each pip extra resolved against the registry; [foundry] installed in a fresh venv and trained with llm-foundry
# (network, a few GB; ARGS=--quick resolves only). Writes bench/results/install_extras.json.
extras: $(STAMP)
	$(BIN)/python bench/install_extras.py $(ARGS)

clean-venv:
	rm -rf $(VENV)
