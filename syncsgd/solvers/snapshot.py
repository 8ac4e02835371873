"""Solver state files in Caffe's two layouts: a binary SolverState (.solverstate) and HDF5
(.solverstate.h5 with /iter, /learned_net, /current_step, /history/<i>).

syncsgd adds the SHA-256 of the weights file written with the state (SolverState field
learned_net_sha256, HDF5 dataset /learned_net_sha256), inside the state itself: a state copied or
moved without its side files still names the one weights file it pairs with. Caffe's readers
skip the addition; states without it (Caffe's, older syncsgd's) read with an empty digest."""
import os

import h5py
import numpy as np

from syncsgd.errors import PrototxtError, WeightsError
from syncsgd.proto import pb
from syncsgd.weights import HDF5_ERRORS, atomic_write, hdf5_blob, read_message_blobs, write_message


class State:
    def __init__(self, iteration, learned_net, current_step, history, learned_net_sha256=""):
        self.iter = iteration
        self.learned_net = learned_net
        self.current_step = current_step
        self.history = history       # arrays to write; read, a list of weights.StoredBlob
        self.learned_net_sha256 = learned_net_sha256     # "" when the state records none


def write_state(path, state, checksum=False):
    if path.endswith(".h5"):
        atomic_write(path, lambda tmp: _write_hdf5(tmp, state), checksum)
        return
    proto = pb.SolverState(iter=state.iter, learned_net=state.learned_net,
                           current_step=state.current_step)
    if state.learned_net_sha256:
        proto.learned_net_sha256 = state.learned_net_sha256
    write_message(path, proto, pb.SolverState.HISTORY_FIELD_NUMBER, state.history, checksum)


def _write_hdf5(path, state):
    with h5py.File(path, "w") as f:
        f.create_dataset("iter", data=np.array([state.iter], np.int32))
        f.create_dataset("learned_net", data=np.bytes_(state.learned_net))
        f.create_dataset("current_step", data=np.array([state.current_step], np.int32))
        if state.learned_net_sha256:
            f.create_dataset("learned_net_sha256", data=np.bytes_(state.learned_net_sha256))
        group = f.create_group("history")
        for i, array in enumerate(state.history):
            group.create_dataset(str(i), data=np.asarray(array, np.float32))


def read_state(path):
    if not os.path.exists(path):
        raise WeightsError(f"{path}: no such solver state file")
    if path.endswith(".h5") or h5py.is_hdf5(path):
        return _read_hdf5(path)
    proto = pb.SolverState()
    try:
        history = read_message_blobs(path, proto, pb.SolverState.HISTORY_FIELD_NUMBER)
    except PrototxtError as e:
        raise WeightsError(str(e)) from None
    return State(proto.iter, proto.learned_net, proto.current_step, history,
                 proto.learned_net_sha256)


def _read_hdf5(path):
    try:
        with h5py.File(path, "r") as f:
            missing = [k for k in ("iter", "history") if k not in f]
            if missing:
                raise WeightsError(f"{path}: not a Caffe HDF5 solver state (no {missing})")
            iteration = int(np.asarray(f["iter"]).reshape(-1)[0])
            learned = _text(f, "learned_net")
            digest = _text(f, "learned_net_sha256")
            step = int(np.asarray(f["current_step"]).reshape(-1)[0]) \
                if "current_step" in f else 0
            group = f["history"]
            history = [hdf5_blob(group[str(i)], path) for i in range(len(group))]
    except HDF5_ERRORS as e:
        raise WeightsError(f"{path}: cannot read as HDF5 (damaged file?): {e}") from None
    return State(iteration, learned, step, history, digest)


def _text(f, name):
    """A string dataset of an HDF5 state, "" when absent."""
    value = f[name][()] if name in f else b""
    return value.decode() if isinstance(value, bytes) else str(value)
