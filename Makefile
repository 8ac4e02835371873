# The README's two Quick start commands: `make demo` (train LeNet on 2 MPI ranks) and `make test`.
PYTHON ?= python3
NP ?= 2
# mpiexec from the mpich wheel lands in Python's scripts folder, which may not be on PATH.
MPIEXEC = $(shell $(PYTHON) -c "import os, shutil, sysconfig; print(shutil.which('mpiexec') or os.path.join(sysconfig.get_path('scripts'), 'mpiexec'))")

.PHONY: install install-test demo test

install:
	$(PYTHON) -m pip install -q -e .

install-test:
	$(PYTHON) -m pip install -q -e '.[test]'

# Build the digits set, train LeNet over $(NP) ranks, print the final test accuracy.
demo: install-test
	$(PYTHON) data/digits.py
	@mkdir -p runs
	$(MPIEXEC) -n $(NP) $(PYTHON) -m mpi4py -m syncsgd.cli train \
		--solver models/lenet/solver.prototxt 2>&1 | tee runs/lenet-demo.log
	@grep -q "Optimization Done" runs/lenet-demo.log
	@grep "Test net output #0" runs/lenet-demo.log | tail -1 | sed 's/.*Test net output #0: /Final test /'

test: install-test
	$(PYTHON) -m pytest -q
