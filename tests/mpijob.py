"""A background `mpiexec -n N python -m mpi4py ...` job whose ranks a test can signal one by one:
the ranks' PIDs (read from /proc, children of the launcher carrying PMI_RANK), their output, and a
clean-up that continues what was stopped and kills only this job's own processes."""
import os
import signal
import subprocess
import sys
import threading
import time

import mpirun


# A small net for jobs that train until a test stops them.
SMALL_NET = """
name: "small"
layer { name: "data" type: "DummyData" top: "data" top: "label"
        dummy_data_param { shape { dim: 8 dim: 3 dim: 8 dim: 8 } shape { dim: 8 }
                           data_filler { type: "gaussian" std: 1 }
                           data_filler { type: "uniform" min: 0 max: 3.99 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "xavier" } } }
layer { name: "fc" type: "InnerProduct" bottom: "conv" top: "fc"
        inner_product_param { num_output: 4 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc" bottom: "label" top: "loss" }
layer { name: "acc" type: "Accuracy" bottom: "fc" bottom: "label" top: "acc"
        include { phase: TEST } }
"""


class Job:
    def __init__(self, n, *args):
        self.n = n
        command = [mpirun.mpiexec(), "-n", str(n), sys.executable, "-m", "mpi4py",
                   *map(str, args)]
        env = dict(os.environ, PYTHONPATH=mpirun.ROOT + os.pathsep +
                   os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(command, cwd=mpirun.ROOT, env=env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.lines = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.pids = {}
        self.stopped = set()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self):
        return "".join(self.lines)

    def wait_for(self, text, timeout=60, count=1):
        """Wait until `text` has appeared `count` times in the output; False if the job ends or
        the time runs out first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.output.count(text) >= count:
                return True
            if self.proc.poll() is not None:
                self._reader.join(timeout=5)
                return self.output.count(text) >= count
            time.sleep(0.05)
        return False

    def rank_pids(self, timeout=30):
        """{rank: pid} of the job's Python processes."""
        deadline = time.monotonic() + timeout
        while len(self.pids) < self.n and time.monotonic() < deadline:
            for pid in _descendants(self.proc.pid):       # parents before children
                rank = _environ(pid).get("PMI_RANK")
                if rank is not None:
                    self.pids.setdefault(int(rank), pid)
            time.sleep(0.05)
        assert len(self.pids) == self.n, f"found the PIDs of ranks {sorted(self.pids)} only"
        return self.pids

    def signal(self, rank, sig):
        os.kill(self.rank_pids()[rank], sig)
        if sig == signal.SIGSTOP:
            self.stopped.add(rank)

    def wait(self, timeout):
        """The launcher's exit status, or None if it has not ended within `timeout` seconds."""
        try:
            status = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        self._reader.join(timeout=5)
        return status

    def cleanup(self):
        """Continue what this test stopped, then kill what is left of this job, by PID."""
        for rank in self.stopped:
            _kill(self.pids[rank], signal.SIGCONT)
        if self.proc.poll() is None:
            for pid in list(self.pids.values()) + [self.proc.pid]:
                _kill(pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self._reader.join(timeout=5)


def _descendants(pid):
    found = []
    todo = [pid]
    while todo:
        parent = todo.pop(0)
        try:
            with open(f"/proc/{parent}/task/{parent}/children") as f:
                children = [int(c) for c in f.read().split()]
        except OSError:
            continue
        found += children
        todo += children
    return found


def _environ(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            entries = f.read().split(b"\0")
    except OSError:
        return {}
    return dict(e.decode(errors="replace").split("=", 1) for e in entries if b"=" in e)


def _kill(pid, sig):
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
