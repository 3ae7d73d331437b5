# Two commands, both on a fresh machine (see README):
#   make course   set up .venv from requirements.txt and open the course in JupyterLab
#   make test     set up .venv and run every test (library, notebooks, browser)
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PORT   ?= 8888

.PHONY: course test setup clean student

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check --upgrade "pip>=24"
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps -e .
	touch $(STAMP)

setup: $(STAMP)

# Headless-friendly: prints the URL with its token; open it in a browser.
course: $(STAMP)
	$(VENV)/bin/jupyter lab --no-browser --ip=127.0.0.1 --port=$(PORT) --notebook-dir=notebooks \
		--ServerApp.open_browser=False

test: $(STAMP)
	$(PY) -m tests.run_all

student: $(STAMP)
	$(PY) -m workbench course student --out student

clean:
	rm -rf $(VENV) student .pytest_cache .hypothesis
