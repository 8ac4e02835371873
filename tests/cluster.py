"""Open MPI and a one-host Slurm for the cluster tests, installed where absent: Debian's packages
with apt-get, and mpi4py built against Open MPI in a venv of its own, kept between runs in
~/.cache. What this machine cannot install (no apt-get, not root, no network) raises Unavailable,
and the tests skip with its reason."""
import fcntl
import functools
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

import mpirun
import netns

OPENMPI_PACKAGES = ("openmpi-bin", "libopenmpi-dev")
SLURM_PACKAGES = ("slurm-wlm", "munge")
# Debian's own names for Open MPI's commands: `mpirun` and `mpicc` may be MPICH's (the mpich
# wheel puts its own first on PATH).
MPIRUN, MPICC = "mpirun.openmpi", "mpicc.openmpi"
VENV = Path.home() / ".cache" / "syncsgd-openmpi-venv"
INSTALL_TIMEOUT = 900       # seconds for apt-get, and for building mpi4py (90 s here)
APT = ("apt-get", "-q", "-o", "Acquire::Retries=0", "-o", "Acquire::http::Timeout=20")


class Unavailable(Exception):
    """What this machine lacks for the test, and why it cannot be installed."""


def install(packages, commands):
    """Debian `packages`, installed with apt-get unless every one of `commands` is on PATH."""
    if all(shutil.which(command) for command in commands):
        return
    if shutil.which("apt-get") is None:
        raise Unavailable(f"{' '.join(commands)} not installed, and no apt-get to install "
                          f"{' '.join(packages)} with")
    if os.geteuid() != 0:
        raise Unavailable(f"installing {' '.join(packages)} needs root")
    _apt_update()
    _apt("install", "-y", *packages)


@functools.cache
def _apt_update():
    _apt("update")


def _apt(*args):
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    try:
        done = subprocess.run([*APT, *args], capture_output=True, text=True, env=env,
                              timeout=INSTALL_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise Unavailable(f"apt-get {args[0]} still running after {INSTALL_TIMEOUT} s") from None
    if done.returncode != 0:
        raise Unavailable(f"apt-get {' '.join(args)} failed: {_tail(done.stderr, 3)}")


def openmpi():
    """(mpirun, python): Open MPI's launcher, and a Python whose mpi4py is built against it."""
    install(OPENMPI_PACKAGES, (MPIRUN, MPICC))
    return shutil.which(MPIRUN), openmpi_python()


def openmpi_python():
    """VENV's Python: this Python's packages (syncsgd, numpy, ...) with mpi4py built against
    Open MPI first on its path. Built once and kept; built again when it does not answer so
    (cut short while building, or made for another Python)."""
    python = VENV / "bin" / "python"
    VENV.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{VENV}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)          # another test session may be building it
        if _venv_problem(python) is not None:
            shutil.rmtree(VENV, ignore_errors=True)
            _build_venv(python)
            problem = _venv_problem(python)
            assert problem is None, f"{VENV}, just built: {problem}"
    return python


def _venv_problem(python):
    """Why `python` is not the venv openmpi_python promises, or None."""
    if not python.exists():
        return "no venv"
    code = "import sys, mpi4py.MPI as m; print(sys.base_prefix); print(m.Get_library_version())"
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        return f"its mpi4py does not load: {_tail(done.stderr, 3)}"
    base, _, library = done.stdout.partition("\n")
    if base != sys.base_prefix:
        return f"made for the Python of {base}"
    if "Open MPI" not in library:
        return f"its mpi4py runs on {library.splitlines()[0]}"
    return None


def _build_venv(python):
    """`MPICC=mpicc pip install --no-binary mpi4py mpi4py`, the same mpi4py version as this
    Python's, in a venv that sees this Python's packages."""
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", VENV], check=True,
                   timeout=300)
    version = metadata.version("mpi4py")
    with tempfile.TemporaryDirectory() as folder:
        fetched = _pip(python, "download", "--no-deps", "--no-binary", "mpi4py",
                       f"mpi4py=={version}", "-d", folder)
        if fetched.returncode != 0:
            raise Unavailable(f"cannot download mpi4py {version}'s source: "
                              f"{_tail(fetched.stderr, 3)}")
        source = next(Path(folder).iterdir())
        libdirs = subprocess.run([MPICC, "--showme:libdirs"], capture_output=True, text=True,
                                 check=True, timeout=60).stdout.split()
        # The mpich wheel puts its libmpi.so in this Python's lib folder, which Python's link
        # line names first: Open MPI's folders must come before it. The binding's speed does not
        # matter here, and -O0 builds it in 90 s instead of 5 minutes (2 busy cores).
        env = dict(os.environ, MPICC=MPICC, CFLAGS="-O0",
                   MPILD=" ".join([MPICC] + [f"-L{libdir}" for libdir in libdirs]))
        built = _pip(python, "install", "--no-cache-dir", "--ignore-installed", "--no-deps",
                     source, env=env)
        assert built.returncode == 0, f"building mpi4py against Open MPI failed:\n" \
                                      f"{_tail(built.stdout + built.stderr, 40)}"


def _pip(python, *args, env=None):
    try:
        return subprocess.run([python, "-m", "pip", *map(str, args)], capture_output=True,
                              text=True, env=env, timeout=INSTALL_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"pip {args[0]} still running after {INSTALL_TIMEOUT} s") from None


def openmpi_env():
    """The environment Open MPI's mpirun needs here: as root it refuses to run without these."""
    return dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")


# What one rank sees of its launch, printed as a JSON line: syncsgd's reading of the launcher's
# variables (who logs is decided before MPI starts), its affinity mask and the thread budget it
# took from them, and the threads OpenBLAS was then given.
PROBE = """
import json
from threadpoolctl import threadpool_info
from syncsgd import log
from syncsgd.kernels.threads import budget, usable_cores
from syncsgd.launcher import launcher_rank, launcher_size
from syncsgd.parallel import world
comm = world()
print(json.dumps({"rank": comm.rank if comm else 0, "launcher_rank": launcher_rank(),
                  "size": launcher_size(), "logs": log.enabled(), "budget": budget(),
                  "cores": sorted(usable_cores()),
                  "openblas": [p["num_threads"] for p in threadpool_info()
                               if p["internal_api"] == "openblas"]}), flush=True)
"""


def probes(output):
    """The PROBE lines of a job's output, by rank (two ranks' lines may share one line)."""
    found = [json.loads(text) for text in re.findall(r'\{"rank": [^{}]*\}', output)]
    return {probe["rank"]: probe for probe in found}


# Job ids start at a random FirstJobId: MPICH under srun names its shared memory after the job
# id, and a rank killed in an earlier test cluster leaves its segment in /dev/shm, which a job of
# the same id (a cluster numbering from 1 again) would take for its own and fail in MPI_Init.
SLURM_CONF = """\
ClusterName=syncsgdtest
FirstJobId={first_job}
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={folder}/munge.socket
CredType=cred/munge
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.pid
ProctrackType=proctrack/pgid
TaskPlugin={task_plugin}
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
JobRequeue=1
KillWait=5
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=test Nodes={node} Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime=60
PartitionName=urgent Nodes={node} MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
"""


# What a Slurm client prints where a message to or from slurmctld was lost on the way.
CONTROLLER_UNREACHED = re.compile(r"missing socket|Unable to contact slurm controller|"
                                  r"Socket timed out|Zero Bytes were transmitted")


def message_lost(result):
    """Whether a Slurm client's message to or from slurmctld was lost on the way: the client says
    so, or it died of SIGPIPE, writing to a socket the other end had closed (scontrol does not
    ignore the signal; CI saw it once under load, silent, exit -13)."""
    return result.returncode == -signal.SIGPIPE or bool(CONTROLLER_UNREACHED.search(result.stderr))


class Slurm:
    """A one-host Slurm in `folder`: munged, slurmctld and slurmd, with a config written there:
    one node of CPUS CPUs (`task_plugin` task/affinity binds each task to its CPUs, task/none
    leaves every task the whole node), the default partition `test`, whose jobs a job of the
    partition `urgent` preempts (SIGTERM, then requeued after 60 s of grace). Each daemon runs in
    a session of its own and is stopped by its PID; job processes still running then are found
    by this cluster's SLURM_CONF in their environment, and killed by PID."""
    CPUS = 2
    NODE = "syncsgd-node"

    def __init__(self, folder, task_plugin="task/affinity"):
        self.folder = Path(folder)
        self.task_plugin = task_plugin
        self.conf = self.folder / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self.daemons = []

    def __enter__(self):
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc):
        self.stop()

    def start(self, timeout=60):
        if os.geteuid() != 0:
            raise Unavailable("slurmd runs jobs as their users: it needs root")
        install(SLURM_PACKAGES, ("munged", "slurmctld", "slurmd", "srun", "sbatch"))
        for name in ("state", "spool"):
            (self.folder / name).mkdir()
        key = self.folder / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        ctld_port, slurmd_port = _free_ports(2)
        self.conf.write_text(SLURM_CONF.format(
            host=socket.gethostname(), ctld_port=ctld_port, slurmd_port=slurmd_port,
            folder=self.folder, node=self.NODE, cpus=self.CPUS, task_plugin=self.task_plugin,
            first_job=random.randrange(10**6, 6 * 10**7)))    # MaxJobId is 67043328
        socket_path = self.folder / "munge.socket"
        self._daemon("munged", "-F", "-f", f"--socket={socket_path}", f"--key-file={key}",
                     *(f"--{kind}-file={self.folder}/munged.{kind}" for kind in
                       ("pid", "log", "seed")))
        self._wait(lambda: socket_path.exists(), timeout, "munged's socket")
        self._daemon("slurmctld", "-D", "-i")
        self._daemon("slurmd", "-D", "-N", self.NODE)
        self._wait(lambda: self.run("sinfo", "-h", "-o", "%t", check=False).stdout.strip()
                   == "idle", timeout, "the node to be idle")

    def _daemon(self, program, *args):
        with open(self.folder / f"{program}.out", "w") as out:
            self.daemons.append(subprocess.Popen(
                [program, *args], env=self.env, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True))

    def _wait(self, ready, timeout, what):
        deadline = time.monotonic() + timeout
        while not ready():
            ended = [d.args[0] for d in self.daemons if d.poll() is not None]
            if ended or time.monotonic() > deadline:
                raise AssertionError(f"Slurm: no {what} within {timeout} s; daemons that "
                                     f"ended: {ended}\n{self.daemon_output()}")
            time.sleep(0.2)

    def daemon_output(self):
        return "\n".join(f"--- {path.name}\n{_tail(path.read_text(), 15)}"
                         for path in sorted(self.folder.glob("*.out")))

    def run(self, *command, timeout=120, check=True):
        """A Slurm client command (srun, scontrol, ...) against this cluster, in the repository
        (mpirun.launch)."""
        return mpirun.launch(command, timeout=timeout, check=check, env=self.env)

    def idempotent(self, *command, attempts=5):
        """A client command that may run twice (scontrol show or update, squeue), run again
        where a message to or from slurmctld was lost (a loaded 2-core host drops one now and
        then)."""
        for attempt in range(attempts):
            result = self.run(*command, check=False)
            if result.returncode == 0 or attempt == attempts - 1 or not message_lost(result):
                break
            time.sleep(1)
        if result.returncode != 0:
            raise AssertionError(f"{' '.join(map(str, command))} exited {result.returncode}:\n"
                                 f"{result.stderr[-3000:]}")
        return result

    def submit(self, *options, attempts=5):
        """sbatch `options`: the job's id. Where the controller's answer was lost the job may or
        may not be in; it is looked up by a name of its own before submitting again, so a job
        never runs twice."""
        name = f"syncsgd-{os.urandom(6).hex()}"
        for attempt in range(attempts):
            result = self.run("sbatch", "--parsable", f"--job-name={name}", *options,
                              check=False)
            if result.returncode == 0:
                return result.stdout.strip().split(";")[0]
            if attempt == attempts - 1 or not message_lost(result):
                break
            time.sleep(1)
            found = self.idempotent("squeue", "-h", "-n", name, "-o", "%i").stdout.split()
            if found:
                return found[0]
        raise AssertionError(f"sbatch {' '.join(map(str, options))} exited {result.returncode}:"
                             f"\n{result.stderr[-3000:]}")

    def stop(self):
        """Kill what runs jobs here (slurmstepd, tasks, batch scripts), then stop the daemons."""
        sessions = {d.pid for d in self.daemons}       # each daemon leads its own
        for pid in _pids_with(f"SLURM_CONF={self.conf}"):
            if _session(pid) not in sessions:
                _kill(pid)
        for daemon in reversed(self.daemons):
            netns.stop(daemon)
        self.daemons.clear()


def _free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _pids_with(entry):
    """PIDs of the processes whose environment holds `entry` (NAME=value)."""
    wanted = entry.encode()
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            try:
                with open(f"/proc/{name}/environ", "rb") as f:
                    if wanted in f.read().split(b"\0"):
                        found.append(int(name))
            except OSError:
                pass
    return found


def _session(pid):
    try:
        return os.getsid(pid)
    except ProcessLookupError:
        return None


def _kill(pid):
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _tail(text, lines):
    return "\n".join((text or "").strip().splitlines()[-lines:])
