# Two entry points, as the README's Quick start says: `make demo` and `make test`.
PYTHON ?= python3
NP ?= 2

.PHONY: install install-test demo test

install:
	$(PYTHON) -m pip install -q -e .

install-test:
	$(PYTHON) -m pip install -q -e '.[test]'

demo: install
	$(PYTHON) -m syncsgd.cli time --model models/alexnet/deploy.prototxt --iterations 2

test: install-test
	$(PYTHON) -m pytest -q
