# hp — the two commands: `make demo` (the main job) and `make test` (the whole suite).
# Both create .venv on first use and reuse it afterwards.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.hp-installed
DISTS  := pyproject.toml hp_plugin_cp/pyproject.toml hp_plugin_moe/pyproject.toml plugins/hp-plugin-phi3/pyproject.toml \
	 plugins/hp-plugin-bloom/pyproject.toml

.PHONY: demo test lint typecheck venv clean bench

venv: $(STAMP)

$(STAMP): $(DISTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: the CPU wheel of 2.13.0, never another version. A setuptools
	# that reads SPDX license metadata (PEP 639): the wheel test builds without isolation.
	$(BIN)/python -m pip install --quiet "torch==2.13.0" "setuptools>=77"
	$(BIN)/python -m pip install --quiet "torch==2.13.0" \
		-e ".[test]" -e ./hp_plugin_cp -e ./hp_plugin_moe -e ./plugins/hp-plugin-phi3 \
		-e ./plugins/hp-plugin-bloom
	$(BIN)/python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/hp plugins
	$(BIN)/hp demo

LINTED := hp_core hp_plugin_cp hp_plugin_moe plugins tests tools examples benchmarks

lint: $(STAMP)
	$(BIN)/ruff check $(LINTED)
	$(BIN)/ruff format --check $(LINTED)

# mypy over hp_core and the four plugin packages, as configured in pyproject.toml [tool.mypy].
typecheck: $(STAMP)
	$(BIN)/mypy --config-file pyproject.toml

test: $(STAMP) lint typecheck
	$(BIN)/python -m pytest --cov=hp_core --cov=hp_plugin_cp --cov=hp_plugin_moe --cov=hp_plugin_bloom \
		--cov-report=term-missing:skip-covered --cov-report=json:.coverage.json
	$(BIN)/python tools/check_coverage.py .coverage.json

bench: $(STAMP)
	$(BIN)/python benchmarks/step_overhead.py
	$(BIN)/python benchmarks/planning_scale.py
	$(BIN)/python benchmarks/verify_scale.py
	$(BIN)/python benchmarks/plugin_discovery.py
	$(BIN)/python benchmarks/memory.py
	$(BIN)/python benchmarks/checkpoint_load.py
	$(BIN)/python benchmarks/collectives.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache .coverage .coverage.json
