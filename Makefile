# Fresh machine: `make demo` (main job) and `make test` (the test suite). Both build .venv first.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: venv demo test report lab gpu clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

demo: venv
	$(BIN)/python -m gbs demo

test: venv
	$(BIN)/python -m pytest -q

# the README's results block and docs/results.md, rendered again from data/bench/*.csv (tests/test_report.py checks them)
report: venv
	$(BIN)/python -m gbs report --write

lab: venv
	$(BIN)/python -m pip install -q -e ".[test,notebooks]"
	$(BIN)/jupyter lab notebooks/

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
