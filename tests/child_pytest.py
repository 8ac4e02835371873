"""A pytest run in a child process, for tests whose subject could crash the process (an engine
bug is a SIGSEGV) or needs an environment read once at start-up (ONEDNN_MAX_CPU_ISA): a crash
then fails the one test, with the child's output and faulthandler's stacks, instead of ending
the suite."""
import subprocess
import sys

import pytest

TAIL = 20000              # characters of each of the child's streams shown on failure


def run(args, env, cwd, timeout, what):
    """pytest `args` in a child (faulthandler on, no cache) in `cwd` with `env`: (return code,
    stdout, a report of both streams' tails for an assertion). A child that outlives `timeout`
    seconds fails the test."""
    command = [sys.executable, "-X", "faulthandler", "-m", "pytest", "-q", "-p",
               "no:cacheprovider", *args]
    try:
        done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{what}: still running after {timeout} s\n"
                    f"--- stdout ---\n{tail(e.stdout)}\n--- stderr ---\n{tail(e.stderr)}")
    report = (f"{what}: return code {done.returncode}\n"
              f"--- stdout ---\n{tail(done.stdout)}\n--- stderr ---\n{tail(done.stderr)}")
    return done.returncode, done.stdout, report


def tail(output):
    """The end of a child's output as text (after a timeout it is bytes, or None)."""
    if isinstance(output, bytes):
        output = output.decode(errors="replace")
    return (output or "")[-TAIL:]
