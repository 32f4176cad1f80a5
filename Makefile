# Set-up and common tasks. `make run` generates with the embedded default model; `make test` runs the suite.
PYTHON ?= $(shell for p in python3.12 python3; do \
  if command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then echo $$p; exit; fi; done; \
  if command -v pyenv >/dev/null 2>&1; then v=$$(pyenv versions --bare | grep '^3\.12' | tail -1); [ -n "$$v" ] && echo "$$(pyenv root)/versions/$$v/bin/python3.12"; fi)
VENV := .venv
BIN := $(VENV)/bin

.PHONY: venv install install-test run chat serve test clean

# Fail early, with the numbers, when the disk cannot hold what pip is about to install:
# $(call need_disk,GB,module) checks only while `module` is not installed yet (pip stages wheels
# beside what it unpacks; measured peaks: 1.1 GB for install, 7.6 GB for install-test).
define need_disk
@$(BIN)/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('$(2)') is None)" 2>/dev/null || { \
  free=$$(df -Pk . | awk 'NR==2 {print int($$4 / 1048576)}'); \
  if [ "$$free" -lt $(1) ]; then \
    echo "error: installing needs about $(1) GB of free disk here, and $$free GB is free (remove old virtual environments or clones)" >&2; \
    exit 1; fi; }
endef

$(BIN)/python:
	@test -n "$(PYTHON)" || { echo "error: no Python 3.12 found (install one, or pass PYTHON=/path/to/python3.12)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

venv: $(BIN)/python

install: venv
	$(call need_disk,2,jax)
	$(BIN)/python -m pip install -q -e .

install-test: venv
	$(call need_disk,8,torch)
	$(BIN)/python -m pip install -q -e '.[test]'

run: install
	$(BIN)/python -m atlasjax chat "What is the capital of France?"

serve: install
	$(BIN)/python -m atlasjax serve

test: install-test
	$(BIN)/python -m pytest -q -n 2 --dist loadfile tests

clean:
	rm -rf $(VENV) build *.egg-info
