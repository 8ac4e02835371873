"""Caffe's (glog's) log line format, so Caffe's tools/extra/parse_log.py reads syncsgd logs:
`I1130 03:10:03.123456  4242 solver.py:0] Iteration 100, loss = 0.25`."""
import logging
import os
import sys
import time

LOGGER = logging.getLogger("syncsgd")


class GlogFormatter(logging.Formatter):
    def format(self, record):
        t = time.localtime(record.created)
        micros = int((record.created % 1) * 1e6)
        prefix = (f"{record.levelname[0]}{t.tm_mon:02d}{t.tm_mday:02d} "
                  f"{t.tm_hour:02d}:{t.tm_min:02d}:{t.tm_sec:02d}.{micros:06d} "
                  f"{os.getpid():>5d} {record.module}.py:{record.lineno}] ")
        return prefix + record.getMessage()


def configure(enabled=True, stream=None):
    """Log to `stream` (stdout) in glog format; ranks other than 0 call this with enabled=False."""
    LOGGER.handlers.clear()
    LOGGER.propagate = False
    if enabled:
        handler = logging.StreamHandler(stream or sys.stdout)
        handler.setFormatter(GlogFormatter())
        LOGGER.addHandler(handler)
        LOGGER.setLevel(logging.INFO)
    else:
        LOGGER.addHandler(logging.NullHandler())
        LOGGER.setLevel(logging.CRITICAL + 1)


def info(message):
    LOGGER.info(message, stacklevel=2)


def fmt(value):
    """A float as C++'s default ostream prints it (6 significant digits), as Caffe's logs do."""
    return format(float(value), ".6g")


def error(message):
    LOGGER.error(message, stacklevel=2)
