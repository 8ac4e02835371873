"""Two hosts on one machine for the MPI tests: two network namespaces joined by a veth pair, and a
launcher that starts an MPICH job across them without ssh (hydra's manual launcher prints one
proxy command per host; each runs inside its own namespace). Every namespace and process made here
is removed by its own name or PID when the `TwoHosts` context ends, whatever happened inside."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import mpirun

# A private /30 that exists only inside the two namespaces made here: nothing outside them
# ever sees a packet to or from it.
ADDRESSES = ("10.231.18.1", "10.231.18.2")
PREFIX = 30
# The transports a job may use: TCP only, so every byte between the ranks crosses the veth link
# (by default UCX would pass them through shared memory, the namespaces sharing one kernel).
TCP_ONLY = {"UCX_TLS": "tcp,self"}


class Unavailable(Exception):
    """This machine cannot make network namespaces (the tests skip with this reason)."""


def _ip(*args, timeout=10):
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout)


def check_available():
    """Raise Unavailable naming what is missing: root, the `ip` tool or namespace support."""
    if not sys.platform.startswith("linux"):
        raise Unavailable("network namespaces are Linux only")
    if os.geteuid() != 0:
        raise Unavailable("making network namespaces needs root")
    if shutil.which("ip") is None:
        raise Unavailable("the `ip` tool (iproute2) is not installed")


class TwoHosts:
    """Namespaces syncsgd-PID-a and -b, addresses ADDRESSES[0] and [1] on the two ends of a veth
    pair, loopback up in each. Use as a context manager; it removes all it made on exit."""

    def __init__(self):
        self.namespaces = (f"syncsgd-{os.getpid()}-a", f"syncsgd-{os.getpid()}-b")
        # Interface names are at most 15 characters.
        self.links = (f"sgd{os.getpid()}a", f"sgd{os.getpid()}b")
        self.addresses = ADDRESSES
        self.processes = []
        self._made = []

    def open(self):
        check_available()
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def __enter__(self):
        return self.open()

    def __exit__(self, *exc):
        self.close()

    def _run(self, *args):
        result = _ip(*args)
        if result.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")

    def _setup(self):
        for ns in self.namespaces:
            result = _ip("netns", "add", ns)
            if result.returncode != 0:
                raise Unavailable(f"cannot make a network namespace ({result.stderr.strip()})")
            self._made.append(ns)
        a, b = self.links
        self._run("link", "add", a, "type", "veth", "peer", "name", b)
        for ns, link, address in zip(self.namespaces, self.links, self.addresses):
            self._run("link", "set", link, "netns", ns)
            self._run("-n", ns, "addr", "add", f"{address}/{PREFIX}", "dev", link)
            self._run("-n", ns, "link", "set", "lo", "up")
            self._run("-n", ns, "link", "set", link, "up")

    def close(self):
        for process in self.processes:
            stop(process)
        # MPI ranks run in sessions of their own, and outlive a proxy that lost its link: every
        # process still inside one of these namespaces was started here.
        for ns in self._made:
            for pid in _ip("netns", "pids", ns).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for ns in reversed(self._made):
            _ip("netns", "del", ns)
        # A veth made but not yet moved into a namespace is still in this one.
        if _ip("link", "show", self.links[0]).returncode == 0:
            _ip("link", "del", self.links[0])
        self._made.clear()

    def set_link(self, host, state):
        """Bring host's end of the veth pair "up" or "down" (down cuts the link both ways)."""
        self._run("-n", self.namespaces[host], "link", "set", self.links[host], state)

    def running(self, host, word):
        """PIDs of the processes inside host's namespace whose command line has `word`."""
        pids = []
        for pid in _ip("netns", "pids", self.namespaces[host]).stdout.split():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if word.encode() in f.read():
                        pids.append(int(pid))
            except FileNotFoundError:
                pass
        return pids

    def received_bytes(self, host):
        """Bytes received so far on host's end of the link."""
        result = _ip("-json", "-statistics", "-n", self.namespaces[host], "link", "show",
                     self.links[host])
        return json.loads(result.stdout)[0]["stats64"]["rx"]["bytes"]

    def start(self, host, command, env, stdout, stderr):
        """Start `command` inside host's namespace, in a session of its own (so stop() ends it
        and its children by its PID)."""
        process = subprocess.Popen(["ip", "netns", "exec", self.namespaces[host], *command],
                                   env=env, stdout=stdout, stderr=stderr,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
        self.processes.append(process)
        return process

    def mpiexec(self, script, *args, workdir, launch_timeout=20):
        """Start a 2-rank `python -m mpi4py SCRIPT ARGS` job, rank 0 on host 0 and rank 1 on
        host 1, MPI traffic over TCP between the two addresses. Returns the running mpiexec
        (the job's output goes to workdir/job.out and job.err, read with `output`)."""
        env = dict(os.environ, PYTHONPATH=mpirun.ROOT + os.pathsep
                   + os.environ.get("PYTHONPATH", ""), **TCP_ONLY)
        hosts = ",".join(f"{address}:1" for address in self.addresses)
        # Each rank's stderr goes straight to workdir/rankN.err: what a rank says just before
        # the job is aborted can be lost on its way through the proxies.
        rank = ["sh", "-c", 'exec "$@" 2>"$0/rank$PMI_RANK.err"', str(workdir)]
        command = [mpirun.mpiexec(), "-launcher", "manual", "-hosts", hosts, "-n", "2", *rank,
                   sys.executable, "-m", "mpi4py", script, *map(str, args)]
        out, err = (os.path.join(workdir, name) for name in ("job.out", "job.err"))
        with open(out, "w") as o, open(err, "w") as e:
            job = self.start(0, command, env, o, e)
        proxies = _launch_lines(out, job, launch_timeout)
        for host, proxy in enumerate(proxies):
            with open(os.path.join(workdir, f"proxy{host}.out"), "w") as o:
                self.start(host, proxy, env, o, subprocess.STDOUT)
        job.files = (out, err, *(os.path.join(workdir, f"rank{r}.err") for r in range(2)))
        return job


def _launch_lines(path, job, timeout):
    """The proxy commands mpiexec's manual launcher prints, in proxy-id (= host) order."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(path) as f:
            text = f.read()
        if "HYDRA_LAUNCH_END" in text:
            lines = sorted(re.findall(r"^HYDRA_LAUNCH: (.*--proxy-id (\d+).*)$", text, re.M),
                           key=lambda m: int(m[1]))
            return [line.split() for line, _ in lines]
        if job.poll() is not None:
            break
        time.sleep(0.05)
    raise RuntimeError(f"mpiexec printed no proxy commands within {timeout} s "
                       f"(exit {job.poll()}):\n{text[-2000:]}")


def output(job):
    """What the job printed so far: mpiexec's stdout and stderr, then each rank's stderr."""
    parts = []
    for path in job.files:
        if os.path.exists(path):
            with open(path) as f:
                parts.append(f.read())
    return "\n".join(parts)


def stop(process, grace=2.0):
    """End a process started by TwoHosts.start and everything in its session, by its PID."""
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=grace)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
