"""Launch `mpiexec -n N python -m mpi4py SCRIPT ...` (or another launcher's command: `launch`) with
a timeout; `python -m mpi4py` makes an uncaught exception on any rank abort the whole job instead
of hanging it."""
import os
import shutil
import subprocess
import sys
import sysconfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def mpiexec():
    """mpiexec on PATH, else the one the mpich wheel put beside this Python's scripts."""
    path = shutil.which("mpiexec") or os.path.join(sysconfig.get_path("scripts"), "mpiexec")
    if not os.path.exists(path):
        raise RuntimeError("mpiexec not found: `pip install mpich` (or load your MPI)")
    return path


def run(n, script, *args, timeout=240, check=True):
    return launch([mpiexec(), "-n", str(n), sys.executable, "-m", "mpi4py", script, *args],
                  timeout=timeout, check=check)


def launch(command, timeout=240, check=True, env=None):
    """Run a launcher's `command` in the repository, which it finds on PYTHONPATH, within
    `timeout` seconds; with `check`, a non-zero exit fails with the output's tail."""
    command = [str(word) for word in command]
    env = dict(env or os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env,
                            cwd=ROOT)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(command)} exited {result.returncode}\n"
                             f"stdout:\n{result.stdout[-4000:]}\nstderr:\n{result.stderr[-4000:]}")
    return result
