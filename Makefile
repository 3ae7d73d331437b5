# Two commands, both on a fresh machine (see README):
#   make course   set up .venv from requirements.txt and open the course in JupyterLab, on a
#                 working copy in $(WORK)/ (made on first use; autosave never touches notebooks/)
#   make test     set up .venv and run every test (library, notebooks, browser)
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PORT   ?= 8888
WORK   ?= work
# JupyterLab refuses to run as root without --allow-root; containers often run as root
ALLOW_ROOT := $(shell [ "$$(id -u)" = 0 ] && echo --allow-root)

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
	$(PY) -m workbench course workcopy --notebooks notebooks --out $(WORK)
	$(VENV)/bin/jupyter lab --no-browser --ip=127.0.0.1 --port=$(PORT) --notebook-dir=$(WORK) \
		--ServerApp.open_browser=False $(ALLOW_ROOT)

test: $(STAMP)
	$(PY) -m tests.run_all

student: $(STAMP)
	$(PY) -m workbench course student --out student

clean:
	rm -rf $(VENV) student .pytest_cache .hypothesis   # $(WORK)/ is yours: not removed
