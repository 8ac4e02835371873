"""Fault injection on the data path: an HDF5 source truncated, rewritten, replaced or deleted under
a run (in process and through `syncsgd train`), each field of a file's identity on its own, read
errors in the prefetch thread, and labels that are NaN or infinite. Every case must end in a
DataError naming the file, the dataset and the rows, never in training on zeros or other data."""
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

import syncsgd
from syncsgd.errors import DataError, ShapeError
from syncsgd.io import hdf5 as h5io
from syncsgd.io.prefetch import DEPTH, Prefetcher
from tests.gradcheck import blobs_from, make_layer, run_forward

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS, CLASSES, BATCH = 64, 4, 8


def write_set(path, seed=0, rows=ROWS, dtype=np.float32, label=None):
    """A small classification set whose data has no zero row."""
    rng = np.random.default_rng(seed)
    with h5py.File(path, "w") as f:
        f["data"] = (rng.standard_normal((rows, 1, 4, 4)) + 3).astype(dtype)
        f["label"] = rng.integers(0, CLASSES, rows).astype(np.float32) if label is None else label
    return str(path)


def write_solver(tmp_path, snapshot=0, max_iter=1000, display=0):
    h5 = write_set(tmp_path / "train.h5")
    (tmp_path / "train.txt").write_text(f"{h5}\n")
    (tmp_path / "net.prototxt").write_text(f"""
    name: "tiny"
    layer {{ name: "data" type: "HDF5Data" top: "data" top: "label"
            hdf5_data_param {{ source: "{tmp_path}/train.txt" batch_size: {BATCH} }} }}
    layer {{ name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
            inner_product_param {{ num_output: {CLASSES} weight_filler {{ type: "xavier" }} }} }}
    layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }}
    """)
    solver = tmp_path / "solver.prototxt"
    solver.write_text(f'net: "{tmp_path}/net.prototxt" type: "SGD" base_lr: 0.01 '
                      f'lr_policy: "fixed" max_iter: {max_iter} snapshot: {snapshot} '
                      f'display: {display} random_seed: 3 snapshot_prefix: "{tmp_path}/snap"')
    return str(solver), h5


# -- what happens to the file -----------------------------------------------------------------

def truncate(path):
    os.truncate(path, 0)


def copy_over(path):
    """Other rows of the same shapes written into the same file (same inode), as `cp` does."""
    other = write_set(f"{path}.other", seed=99)
    with open(other, "rb") as src, open(path, "wb") as dst:
        shutil.copyfileobj(src, dst)


def replace(path):
    """Other rows renamed over the file, as a tool that writes atomically does."""
    write_set(f"{path}.new", seed=99)
    os.replace(f"{path}.new", path)


def delete(path):
    os.remove(path)


CHANGES = {"truncate": (truncate, r"size \d+ -> 0"), "copy over": (copy_over, "mtime_ns"),
           "replace": (replace, "inode"), "delete": (delete, "deleted")}


def changed_message(path, change):
    """The error for a changed file: from the check as the net takes a batch (both datasets) or,
    when the reader thread met the change first, from its read of one dataset."""
    return (rf"HDF5 file '{re.escape(path)}' changed during training \([^)]*{change}[^)]*\) while "
            rf"reading rows \d+\.\.\d+ of (datasets 'data', 'label'|dataset '(data|label)'); "
            rf".*restore .*or restart")


def snapshots(tmp_path):
    return sorted(p.name for p in tmp_path.glob("snap_iter_*"))


def snapshot_iterations(tmp_path):
    return {int(re.search(r"_iter_(\d+)\.", name).group(1)) for name in snapshots(tmp_path)}


def params_of(net):
    return [b.data.copy() for blobs in net.params.values() for b in blobs]


def solver_for(tmp_path, **kwargs):
    path, h5 = write_solver(tmp_path, **kwargs)
    solver = syncsgd.get_solver(path)
    return solver, h5


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_source_changed_under_training_stops_it_before_the_next_update(tmp_path, change):
    solver, h5 = solver_for(tmp_path, snapshot=2)
    try:
        solver.step(4)                         # the next batches are read ahead by now
        before, files = params_of(solver.net), snapshots(tmp_path)
        assert snapshot_iterations(tmp_path) == {2, 4}
        mutate, what = CHANGES[change]
        time.sleep(0.05)                       # a new mtime even on coarse clocks
        mutate(h5)
        start = time.monotonic()
        with pytest.raises(DataError, match=changed_message(h5, what)):
            solver.step(10)
        assert time.monotonic() - start < 10
        assert solver.iter == 4                # no update from any batch taken after the change
        for a, b in zip(before, params_of(solver.net)):
            np.testing.assert_array_equal(a, b)
        assert snapshots(tmp_path) == files
        with pytest.raises(DataError, match="changed during training"):
            solver.step(1)                     # and it stays an error
    finally:
        solver.close()


def test_a_changed_list_file_stops_training(tmp_path):
    solver, _ = solver_for(tmp_path)
    try:
        solver.step(2)
        listed = tmp_path / "train.txt"
        time.sleep(0.05)
        listed.write_text(listed.read_text())  # the same text, written again
        with pytest.raises(DataError, match=rf"HDF5 list file '{re.escape(str(listed))}' changed "
                                            rf"during training \(.*mtime_ns.*\) while reading "
                                            rf"global rows 16..23 of datasets 'data', 'label'"):
            solver.step(1)
        assert solver.iter == 2
    finally:
        solver.close()


def test_errors_from_the_prefetch_thread_reach_training(tmp_path, monkeypatch):
    """Without the check as the net takes a batch, the reader thread's own check (after each
    read) must stop the run: its error reaches the training thread, within the batches read
    ahead, and no row trained on is zero."""
    monkeypatch.setattr(h5io.H5Source, "check", lambda self, rows: None)
    solver, h5 = solver_for(tmp_path)
    seen = []
    solver.net.forward_hooks.append(
        lambda i: i == 1 and seen.append(solver.net.blobs["data"].data.copy()))
    try:
        solver.step(3)
        truncate(h5)
        start = time.monotonic()
        with pytest.raises(DataError, match=changed_message(h5, r"size \d+ -> 0")) as info:
            solver.step(100)
        assert time.monotonic() - start < 10
        assert solver.iter <= 3 + DEPTH + 1    # only batches read before the change were used
        assert "reading" in str(info.value)
        layer = solver.net.layers[0]
        assert not layer._prefetch.thread.is_alive()
        for batch in seen:
            assert np.abs(batch).reshape(len(batch), -1).max(axis=1).min() > 0
    finally:
        solver.close()


def cli_train(solver, log):
    """`syncsgd train` logging to the file `log` (a pipe nobody reads could fill and block it)."""
    return subprocess.Popen([sys.executable, "-m", "syncsgd.cli", "train", "--solver", solver],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log)


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_train_command_ends_with_the_error_when_its_source_changes(tmp_path, change):
    solver, h5 = write_solver(tmp_path, snapshot=20, max_iter=10 ** 7)
    log = open(tmp_path / "train.log", "w")  # noqa: SIM115 (closed once the run has ended)
    proc = cli_train(solver, log)
    try:
        deadline = time.monotonic() + 120
        while not snapshot_iterations(tmp_path) and proc.poll() is None:
            assert time.monotonic() < deadline, "no snapshot within 120 s"
            time.sleep(0.05)
        assert proc.poll() is None, (tmp_path / "train.log").read_text()[-2000:]
        os.kill(proc.pid, signal.SIGSTOP)      # hold the run while the file changes
        try:
            held = snapshot_iterations(tmp_path)
            CHANGES[change][0](h5)
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    err = (tmp_path / "train.log").read_text()
    assert proc.returncode == 1, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert re.fullmatch("syncsgd train: error: " + changed_message(h5, CHANGES[change][1]) + ".*",
                        last), last
    assert "Traceback" not in err and "Optimization Done" not in err
    # At most the snapshot of the iteration under way when the run was held, whose batch was
    # read before the change; none after it.
    late = snapshot_iterations(tmp_path) - held
    assert late <= {max(held) + 20}, (held, late)


# -- each field of a file's identity ------------------------------------------------------------

def one_file_source(tmp_path, **kwargs):
    h5 = write_set(tmp_path / "a.h5", **kwargs)
    (tmp_path / "list.txt").write_text(f"{h5}\n")
    return h5io.H5Source(str(tmp_path / "list.txt"), ["data", "label"]), h5


def keep_times(path, stat):
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def grow(path):
    """Size only: bytes appended, the times put back."""
    stat = os.stat(path)
    with open(path, "ab") as f:
        f.write(bytes(16))
    keep_times(path, stat)


def touch(path):
    """Modification time only."""
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10 ** 9))


def swap_inode(path):
    """Inode only: an identical copy (same bytes and times) renamed over the file."""
    shutil.copy2(path, f"{path}.copy")
    os.replace(f"{path}.copy", path)


@pytest.mark.parametrize("field,alter", [("size", grow), ("mtime_ns", touch),
                                         ("inode", swap_inode)])
def test_each_identity_field_is_checked_on_read(tmp_path, field, alter):
    source, h5 = one_file_source(tmp_path)
    try:
        np.testing.assert_array_equal(source.read("data", [0, 1]).shape, (2, 1, 4, 4))
        recorded = source.identities[0]
        alter(h5)
        now = h5io.Identity.of(os.stat(h5))
        assert [f for f in recorded._fields if getattr(now, f) != getattr(recorded, f)] == [field]
        with pytest.raises(DataError, match=rf"a.h5' changed during training \({field} "
                                            rf"{getattr(recorded, field)} -> {getattr(now, field)}"
                                            rf"\) while reading rows 2..5 of dataset 'label'"):
            source.read("label", [2, 3, 4, 5])
    finally:
        source.close()


def test_device_field_is_checked(tmp_path):
    """No test can move a file to another device in place; a source that recorded another
    device must refuse the file all the same."""
    source, _ = one_file_source(tmp_path)
    try:
        recorded = source.identities[0]
        source.identities[0] = recorded._replace(device=recorded.device + 1)
        with pytest.raises(DataError, match=r"\(device \d+ -> \d+\) while reading row 7 of "
                                            r"dataset 'data'"):
            source.read("data", [7])
    finally:
        source.close()


@pytest.mark.parametrize("shape,dtype", [((ROWS, 4, 2, 2), np.float32),
                                         ((ROWS, 1, 4, 4), np.int32)])
def test_dataset_shape_and_type_are_checked_when_a_file_is_opened_again(tmp_path, shape, dtype):
    """A file rewritten in place with the same size and times but a dataset of another shape or
    type: the identity check cannot see it, the check of the datasets on reopening does."""
    source, h5 = one_file_source(tmp_path)
    try:
        source.read("data", [0])
        source.close()                         # as when more than OPEN_FILES files are listed
        stat = os.stat(h5)
        with h5py.File(h5, "r") as f:
            labels = f["label"][...]
        with h5py.File(h5, "w") as f:
            f["data"] = np.ones(shape, dtype)
            f["label"] = labels
        keep_times(h5, stat)
        assert h5io.Identity.of(os.stat(h5)) == source.identities[0]
        was = (ROWS, 1, 4, 4), np.dtype(np.float32).str
        now = shape, np.dtype(dtype).str
        with pytest.raises(DataError, match=re.escape(f"(dataset 'data' {was} -> {now}) while "
                                                      f"reading rows 0..1 of dataset 'data'")):
            source.read("data", [0, 1])
    finally:
        source.close()


def test_a_change_of_working_directory_is_not_a_change_of_the_source(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    write_set(tmp_path / "data" / "a.h5")
    (tmp_path / "data" / "list.txt").write_text("data/a.h5\n")   # relative, as Caffe's lists
    monkeypatch.chdir(tmp_path)
    source = h5io.H5Source("data/list.txt", ["data", "label"])
    try:
        expected = source.read("label", [1, 2])
        monkeypatch.chdir(tmp_path / "data")
        source.check([1, 2])
        source.close()                          # reopened from where it was found
        np.testing.assert_array_equal(source.read("label", [1, 2]), expected)
    finally:
        source.close()


def test_a_read_error_names_the_file_dataset_and_rows(tmp_path, monkeypatch):
    source, h5 = one_file_source(tmp_path)

    def failing(dataset, runs, out):
        raise OSError("Can't read data (file read failed)")
    monkeypatch.setattr(h5io, "read_runs", failing)
    try:
        with pytest.raises(DataError, match=rf"{re.escape(h5)}: reading rows of dataset 'label' "
                                            rf"failed at 3 rows in 4..9 \(Can't read data"):
            source.read("label", [9, 4, 5])
    finally:
        source.close()


def test_the_checks_cost_one_stat_per_file_and_read_no_data(tmp_path, monkeypatch):
    """What a batch pays: per file read, one stat after the read; as the layer takes the batch,
    one stat of the list file and one per file it came from, and no data read again."""
    paths = [write_set(tmp_path / f"p{i}.h5", seed=i, rows=10) for i in range(3)]
    (tmp_path / "list.txt").write_text("".join(f"{p}\n" for p in paths))
    source = h5io.H5Source(str(tmp_path / "list.txt"), ["data", "label"])
    stats = []
    real_stat = os.stat
    monkeypatch.setattr(h5io.os, "stat", lambda path: stats.append(str(path)) or real_stat(path))
    try:
        rows = np.array([12, 3, 14, 5])       # files 1, 0, 1, 0
        source.read("data", rows)
        assert sorted(stats) == sorted(paths[:2])
        stats.clear()

        def no_reads(*args):
            raise AssertionError("check() read data")
        monkeypatch.setattr(h5io, "read_runs", no_reads)
        source.check(rows)
        assert sorted(stats) == sorted([str(tmp_path / "list.txt"), *paths[:2]])
    finally:
        source.close()


# -- prefetch ---------------------------------------------------------------------------------

@pytest.mark.parametrize("failure", [SystemExit(3), DataError("rows 0..7 are gone")])
def test_prefetch_hands_on_any_exception_without_hanging(failure):
    def produce(k):
        if k == 1:
            time.sleep(0.2)
            raise failure
        return k

    prefetcher = Prefetcher(produce)
    try:
        assert prefetcher.get() == 0
        start = time.monotonic()
        with pytest.raises(type(failure)) as info:
            prefetcher.get()
        assert info.value is failure and time.monotonic() - start < 5
        prefetcher.thread.join(5)
        assert not prefetcher.thread.is_alive()
    finally:
        prefetcher.close()


# -- labels -----------------------------------------------------------------------------------

@pytest.mark.parametrize("value,words", [(np.nan, "is NaN"), (np.inf, r"is \+inf"),
                                         (-np.inf, "is -inf"),
                                         (7, "label 7 of sample 5 of the batch is outside 0..3"),
                                         (1e30, (r"label \d+ of sample 5 of the batch is "
                                                 r"outside 0..3; fix the labels data$"))])
@pytest.mark.parametrize("layer_type", ["SoftmaxWithLoss", "Accuracy", "HingeLoss",
                                        "MultinomialLogisticLoss"])
def test_bad_labels_are_named_with_the_layer_and_the_sample(value, words, layer_type):
    scores = np.full((4, CLASSES), 0.25, np.float32)
    labels = np.array([0, 1, value, 2], np.float32)
    layer = make_layer(f"name: 'judge' type: '{layer_type}'")
    layer.ctx.batch_offset = 3                 # this rank's samples are 3..6 of the batch
    if not np.isfinite(value):
        words = f"the label of sample 5 of the batch {words}; labels must be class indices 0..3"
    with pytest.raises(ShapeError, match=rf"^layer 'judge' \({layer_type}\): {words}"):
        run_forward(layer, blobs_from([scores, labels]))


def test_nan_label_in_spatial_labels_names_the_position():
    scores = np.zeros((2, CLASSES, 2, 3), np.float32)
    labels = np.zeros((2, 1, 2, 3), np.float32)
    labels[1, 0, 1, 2] = np.nan
    with pytest.raises(ShapeError, match=r"the label of sample 1 of the batch \(position 5\) is "
                                         r"NaN"):
        run_forward(make_layer("type: 'SoftmaxWithLoss'"), blobs_from([scores, labels]))


def test_nan_label_in_the_training_file_stops_training_naming_layer_and_sample(tmp_path):
    path, h5 = write_solver(tmp_path)
    with h5py.File(h5, "r") as f:
        labels = f["label"][...]
    labels[13] = np.nan                        # sample 5 of batch 1
    write_set(h5, label=labels)
    solver = syncsgd.get_solver(path)
    try:
        with pytest.raises(ShapeError, match=r"layer 'loss' \(SoftmaxWithLoss\): the label of "
                                             r"sample 5 of the batch is NaN"):
            solver.step(3)
        assert solver.iter == 1
    finally:
        solver.close()

