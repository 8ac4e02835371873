"""A progress bar (iterations/s, ETA) for people watching a terminal; silent under CI, in logs
redirected to files, and on every rank but 0."""
import contextlib
import os
import sys

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from syncsgd import log


@contextlib.contextmanager
def progress(total, enabled=True, description="train"):
    active = enabled and sys.stderr.isatty() and not os.environ.get("CI")
    bar = tqdm(total=total, desc=description, unit="it", leave=False,
               disable=not active)
    if not active:
        yield bar
        bar.close()
        return
    with logging_redirect_tqdm(loggers=[log.LOGGER]):
        yield bar
    bar.close()
