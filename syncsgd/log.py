"""Caffe's logs: glog's line format on stderr, from the command line and from Python alike (as
pycaffe, with no set-up), so that `syncsgd train ... 2> train.log` captures what Caffe prints and
Caffe's tools/extra/parse_log.py reads it:
`I1130 03:10:03.123456  4242 solver.py:149] Iteration 100, loss = 0.25`.

glog's settings work as in Caffe's tool: GLOG_minloglevel (0 INFO, 1 WARNING, 2 ERROR, 3 FATAL)
hides the levels below it; GLOG_log_dir (or `--log_dir`) also writes glog's files there,
`<program>.<host>.<user>.log.INFO.<yyyymmdd-hhmmss>.<pid>` (WARNING and ERROR likewise) with a
`<program>.INFO` link to the newest, unless GLOG_logtostderr is set. Without a log dir no file is
written (glog would write to /tmp). Under an MPI launcher only rank 0 logs.
"""
import getpass
import logging
import os
import socket
import sys
import threading
import time

from syncsgd.launcher import launcher_rank

LOGGER = logging.getLogger("syncsgd")

_LETTER = {logging.DEBUG: "I", logging.INFO: "I", logging.WARNING: "W", logging.ERROR: "E",
           logging.CRITICAL: "F"}
_MIN_LEVELS = (logging.INFO, logging.WARNING, logging.ERROR, logging.CRITICAL)
_FILE_LEVELS = {logging.INFO: "INFO", logging.WARNING: "WARNING", logging.ERROR: "ERROR"}


class GlogFormatter(logging.Formatter):
    def format(self, record):
        t = time.localtime(record.created)
        micros = int((record.created % 1) * 1e6)
        prefix = (f"{_LETTER.get(record.levelno, 'I')}{t.tm_mon:02d}{t.tm_mday:02d} "
                  f"{t.tm_hour:02d}:{t.tm_min:02d}:{t.tm_sec:02d}.{micros:06d} "
                  f"{threading.get_native_id():>5d} {record.filename}:{record.lineno}] ")
        message = record.getMessage()
        # glog ends a line with one newline, the message's own if it has one (proto dumps)
        return prefix + message.removesuffix("\n")


class _Stderr(logging.StreamHandler):
    """Writes to sys.stderr as it is when a line is logged, so that redirections made after
    import (pytest's capture, contextlib.redirect_stderr) see the lines."""

    def __init__(self):
        logging.Handler.__init__(self)

    @property
    def stream(self):
        return sys.stderr


class _GlogFile(logging.Handler):
    """One of glog's per-severity files (it holds that severity and the ones above), opened at
    its first line, with glog's header and the `<program>.<SEVERITY>` link beside it."""

    def __init__(self, directory, level, program):
        super().__init__(level)
        self.directory = directory
        self.program = program
        self.file = None
        self.failed = False

    def emit(self, record):
        if self.failed:
            return
        try:
            if self.file is None:
                self.file = self._open(record.created)
            self.file.write(self.format(record) + "\n")
            self.file.flush()
        except OSError as e:
            self.failed = True
            sys.stderr.write(f"syncsgd: cannot write log files to {self.directory}: "
                             f"{e.strerror or e}; logging to stderr only\n")

    def _open(self, created):
        t = time.localtime(created)
        host = socket.gethostname()
        severity = _FILE_LEVELS[self.level]
        name = (f"{self.program}.{host}.{_user()}.log.{severity}."
                f"{time.strftime('%Y%m%d-%H%M%S', t)}.{os.getpid()}")
        os.makedirs(self.directory, exist_ok=True)
        stream = open(os.path.join(self.directory, name), "a")
        stream.write(f"Log file created at: {time.strftime('%Y/%m/%d %H:%M:%S', t)}\n"
                     f"Running on machine: {host}\n"
                     "Log line format: [IWEF]mmdd hh:mm:ss.uuuuuu threadid file:line] msg\n")
        link = os.path.join(self.directory, f"{self.program}.{severity}")
        try:
            if os.path.islink(link):
                os.remove(link)
            os.symlink(name, link)
        except OSError:
            pass                    # glog too goes on without its link
        return stream

    def close(self):
        if self.file is not None:
            self.file.close()
            self.file = None
        super().close()


def _user():
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "invalid-user"       # glog's name when it cannot tell


def _program():
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return name if name and name not in ("-c", "-", "__main__.py") else "python"


def _flag(name):
    """A glog boolean from the environment, as gflags reads it."""
    return os.environ.get(name, "").strip().lower() in ("1", "t", "true", "y", "yes")


def _min_level():
    value = os.environ.get("GLOG_minloglevel", "0").strip()
    level = int(value) if value.isdigit() else 0
    return _MIN_LEVELS[min(level, len(_MIN_LEVELS) - 1)]


def configure(enabled=None, stream=None, log_dir=None, program=None):
    """Send the log to `stream` (by default stderr) and, with `log_dir` (by default
    GLOG_log_dir), to glog's files named after `program` (by default the script's name).
    `enabled` defaults to "this is rank 0 of the MPI launch" (True without a launcher)."""
    for handler in LOGGER.handlers:
        handler.close()
    LOGGER.handlers.clear()
    LOGGER.propagate = False
    if enabled is None:
        enabled = launcher_rank() == 0
    if not enabled:
        LOGGER.addHandler(logging.NullHandler())
        LOGGER.setLevel(logging.CRITICAL + 1)
        return
    handlers = [logging.StreamHandler(stream) if stream is not None else _Stderr()]
    log_dir = log_dir or os.environ.get("GLOG_log_dir")
    if log_dir and not _flag("GLOG_logtostderr"):
        handlers += [_GlogFile(log_dir, level, program or _program()) for level in _FILE_LEVELS]
    for handler in handlers:
        handler.setFormatter(GlogFormatter())
        LOGGER.addHandler(handler)
    LOGGER.setLevel(_min_level())


def info(message):
    LOGGER.info(message, stacklevel=2)


def enabled():
    """Whether INFO lines are written: skip costly messages (dumps) on the ranks that do not log."""
    return LOGGER.isEnabledFor(logging.INFO)


def fmt(value):
    """A float as C++'s default ostream prints it (6 significant digits), as Caffe's logs do."""
    return format(float(value), ".6g")


def error(message):
    LOGGER.error(message, stacklevel=2)


configure()
