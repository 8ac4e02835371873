"""`python -m syncsgd.cli VERB ...`, the form that runs under `mpiexec ... python -m mpi4py`."""
import sys

from syncsgd.cli import main

sys.exit(main())
