# Two entry points do all set-up: `make demo` and `make test`. `make demo` builds .venv from the demo lock
# (requirements/demo.txt: what the demo needs); `make test` / `make lint` / `make bench` from the dev lock
# (requirements/dev.txt: the demo lock + every extra, test and lint tools). A stamp per lock rebuilds .venv when
# its lock or pyproject.toml changed, and never touches a current one. scripts/lock.py regenerates the locks.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
DEMO_STAMP := $(VENV)/.demo-lock.stamp
DEV_STAMP := $(VENV)/.dev-lock.stamp
# Another torch build instead of the locks' (x86_64 CUDA wheels), e.g. on aarch64:
#   make demo TORCH="torch==2.9.1 torchvision==0.24.1"
# It replaces the locks' torch group (torch, torchvision, triton and the nvidia-*/cuda-* runtime of the x86_64
# wheels); pip resolves the new build's own dependencies.
TORCH ?=
TORCH_GROUP := ^(torch|torchvision|triton|nvidia-[a-z0-9-]+|cuda-[a-z-]+)==

.PHONY: venv venv-demo demo test test-fast lint bench extras lock clean-venv

# $(1): a lock file. Its packages (less the torch group when TORCH is set) with their dependencies pinned by the
# lock, then the `# --no-deps` ones (Composer), then grape_stream itself, editable.
# --no-compile, then compileall on every core: pip byte-compiles each installed file one at a time, most of a
# warm-cache set-up on the 2-core machine (95 s for the dev lock this way); the .pyc files are still made at
# set-up: with PYTHONDONTWRITEBYTECODE set (this machine sets it) a lazily compiled venv compiled every import
# from source in every process, and the suite ran far slower.
# A file that does not compile (a template, a Python 2 example) is skipped, as pip skips it. Left out: Oracle's
# SDK (`oci`, 18,000 of the venv's 42,000 files, 12 s of the 43), which Composer and streaming import only for an
# oci:// URL; Python compiles it on first use then.
define install_lock
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade "pip>=24"
	grep -v -e '# --no-deps' $(1) $(if $(TORCH),| grep -Ev '$(TORCH_GROUP)') > $(VENV)/lock.deps.txt || true
	$(BIN)/python -m pip install -q --no-compile -r $(VENV)/lock.deps.txt $(TORCH)
	$(BIN)/python -m pip install -q --no-compile --no-deps $$(grep -e '# --no-deps' $(1) | cut -d' ' -f1)
	$(BIN)/python -m compileall -q -j 0 -x '/site-packages/oci/' $$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') > /dev/null || true
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
endef

venv-demo: $(DEMO_STAMP)
venv: $(DEV_STAMP)

$(DEMO_STAMP): requirements/demo.txt pyproject.toml
	$(call install_lock,requirements/demo.txt)
	@touch $@

$(DEV_STAMP): requirements/dev.txt pyproject.toml
	$(call install_lock,requirements/dev.txt)
	@touch $@ $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/grape-stream demo $(ARGS)

# The suite on parallel workers (pytest-xdist; tests/conftest.py says what keeps a test safe there): two on the
# 2-core CI machine, each test module whole on one worker (its module-scoped fixtures built once), the longest
# modules first. Three filled the cores better (.ci/run 902 s against ~990 s), but under three a multi-rank job
# still split on streaming's shared-memory prefix in 1 of 3 clean-clone runs (a removal that waited 60 s for the
# registration lock went ahead without it): two until that is found. `XDIST="-n 3 ..."` to try; `XDIST=` runs it
# in one process.
XDIST ?= -n 2 --dist loadfile --no-loadscope-reorder
test: $(DEV_STAMP)
	$(BIN)/python -m pytest -q $(XDIST) $(ARGS)

# The fast unit tests only (no servers, processes, Spark or training runs).
test-fast: $(DEV_STAMP)
	$(BIN)/python -m pytest -q -m "not integration" $(XDIST) $(ARGS)

lint: $(DEV_STAMP)
	$(BIN)/ruff check grape_stream tests bench scripts
	$(BIN)/mypy

# Every bench script in turn (ARGS=--quick for a smoke run that leaves bench/results/ alone).
bench: $(DEV_STAMP)
	$(BIN)/python bench/run_all.py $(ARGS)

# Each pip extra resolved against the registry; [foundry] installed in a fresh venv and trained with llm-foundry
# (network, a few GB; ARGS=--quick resolves only). Writes bench/results/install_extras.json.
extras: $(DEV_STAMP)
	$(BIN)/python bench/install_extras.py $(ARGS)

# Regenerate requirements/demo.txt and dev.txt from requirements/*.in (pip's resolver, dry run in a fresh venv).
lock:
	$(PY) scripts/lock.py $(ARGS)

clean-venv:
	rm -rf $(VENV)
