"""Training logs (syncsgd's or Caffe's, glog format) parsed into the tables of Caffe's
tools/extra/parse_log.py: LOG.train and LOG.test, with columns NumIters, Seconds, LearningRate
and one column per net output.

Rows are made as Caffe's script makes them: a row per iteration at which a net output was
logged, Seconds counted from the "Solving" line (else the first time-stamped line), glog's
month-day stamps carried across new year. Two choices differ, on purpose:
- LearningRate is the rate logged for the row's iteration (`Iteration N, lr = X`, or the latest
  one before it), where Caffe's script takes the last rate printed before the row, which is
  the previous display's; rows before the first rate take the first rate, as in Caffe.
- A second test pass at the same iteration (several test nets with the same output names)
  starts a new row rather than overwriting the first.
Lines without a glog prefix are skipped; text before the prefix (mpiexec's rank tags) is
allowed.
"""
import csv
import datetime
import os
import re
from bisect import bisect_right
from dataclasses import dataclass, field

from syncsgd.errors import SyncSGDError

NUMBER = r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|[-+]?(?:nan|inf)\b)"
GLOG = re.compile(r"[IWEF](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d{1,6})\s+\S+\s+[^\s\]]+\]")
ITERATION = re.compile(r"Iteration (\d+)")
LEARNING_RATE = re.compile(r"\blr = " + NUMBER, re.IGNORECASE)
SMOOTHED_LOSS = re.compile(r"Iteration (\d+)(?: \([^)]*\))?, loss = " + NUMBER, re.IGNORECASE)
OUTPUTS = {kind: re.compile(kind + r" net output #\d+: (\S+) = " + NUMBER, re.IGNORECASE)
           for kind in ("Train", "Test")}
FIXED_COLUMNS = ["NumIters", "Seconds", "LearningRate"]


@dataclass
class Log:
    """A parsed log. train/test: rows (dicts) of the two tables; losses: the displayed
    (smoothed) training loss lines as (iteration, seconds, loss)."""
    name: str = "log"
    train: list = field(default_factory=list)
    test: list = field(default_factory=list)
    losses: list = field(default_factory=list)

    def columns(self, table):
        """Column names of `table` ("train" or "test") in first-seen order."""
        names = list(FIXED_COLUMNS)
        for row in getattr(self, table):
            names.extend(k for k in row if k not in names)
        return names


class _Clock:
    """Seconds since the start of a glog log: glog stamps carry no year, so a month going
    backwards means a new year."""

    def __init__(self, year):
        self.year = year
        self.last = None
        self.start = None

    def stamp(self, match):
        month, day, hour, minute, second, fraction = match.groups()
        micros = int(fraction.ljust(6, "0"))
        when = self._datetime(int(month), int(day), int(hour), int(minute), int(second), micros)
        if self.last is not None and when < self.last and when.month < self.last.month:
            self.year += 1
            when = self._datetime(when.month, when.day, when.hour, when.minute, when.second,
                                  micros)
        self.last = when
        return when

    def _datetime(self, *parts):
        try:
            return datetime.datetime(self.year, *parts)
        except ValueError:   # 29 February in a year guessed wrong
            return datetime.datetime(self.year, 2, 28, *parts[2:]) + datetime.timedelta(days=1)

    def seconds(self, when):
        return (when - self.start).total_seconds()


def parse_log(source, year=None, name=None):
    """Parse a log file path, or an iterable of lines, into a Log.

    `year` is the year the log starts in (default: the file's modification year, or this
    year); it only matters for logs that span 29 February."""
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not os.path.isfile(path):
            raise SyncSGDError(f"log '{path}' not found")
        if year is None:
            year = datetime.datetime.fromtimestamp(os.path.getmtime(path)).year
        with open(path, errors="replace") as f:
            return _parse(f, year, name or os.path.basename(path))
    return _parse(source, year or datetime.date.today().year, name or "log")


def _parse(lines, year, name):
    clock = _Clock(year)
    log = Log(name)
    rates = []     # (iteration, rate) in log order
    current = {"train": None, "test": None}
    iteration = None
    for line in lines:
        match = GLOG.search(line)
        if not match:
            continue
        when = clock.stamp(match)
        text = line[match.end():]
        if clock.start is None or ("Solving" in text and not (log.train or log.test)):
            clock.start = when
        found = ITERATION.search(text)
        if found:
            iteration = int(found.group(1))
        if iteration is None:
            continue
        seconds = clock.seconds(when)
        found = LEARNING_RATE.search(text)
        if found:
            rates.append((iteration, float(found.group(1))))
        found = SMOOTHED_LOSS.search(text)
        if found:
            log.losses.append((int(found.group(1)), seconds, float(found.group(2))))
        for kind, pattern in OUTPUTS.items():
            found = pattern.search(text)
            if not found:
                continue
            table = kind.lower()
            row = current[table]
            output, value = found.group(1), float(found.group(2))
            if row is None or row["NumIters"] != iteration or output in row:
                row = {"NumIters": iteration, "Seconds": seconds, "LearningRate": None}
                current[table] = row
                getattr(log, table).append(row)
            row[output] = value
    _fill_rates(log.train + log.test, rates)
    return log


def _fill_rates(rows, rates):
    """Each row's rate: the one logged at its iteration or the latest before; else the first."""
    ordered = sorted(rates, key=lambda r: r[0])   # stable: the last logged rate of an iteration
    iterations = [it for it, _ in ordered]        # wins through bisect_right
    for row in rows:
        if not ordered:
            row["LearningRate"] = float("nan")
            continue
        k = bisect_right(iterations, row["NumIters"]) - 1
        row["LearningRate"] = ordered[max(k, 0)][1]


def write_tables(log, out_dir, basename=None, delimiter=","):
    """Write OUT_DIR/BASENAME.train and .test (BASENAME: the log's file name), each only when
    it has rows, as Caffe's script does. Returns the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for table in ("train", "test"):
        rows = getattr(log, table)
        if not rows:
            continue
        path = os.path.join(out_dir, f"{basename or log.name}.{table}")
        with open(path, "w", newline="") as f:
            writer = csv.writer(f, delimiter=delimiter)
            columns = log.columns(table)
            writer.writerow(columns)
            writer.writerows([_cell(row.get(c)) for c in columns] for row in rows)
        written.append(path)
    return written


def _cell(value):
    if value is None:
        return ""
    if isinstance(value, int):
        return str(value)
    return repr(float(value))


def read_table(path, delimiter=","):
    """A table written by write_tables (or by Caffe's script) as a list of dicts of floats."""
    with open(path, newline="") as f:
        return [{k: float(v) if v != "" else float("nan") for k, v in row.items()}
                for row in csv.DictReader(f, delimiter=delimiter)]
