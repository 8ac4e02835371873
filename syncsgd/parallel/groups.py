"""Collectives inside a model-parallel group (docs/method.md "Model and hybrid parallelism").

A group of P consecutive ranks holds the samples of its members' data shards, concatenated in rank
order, and splits a fully connected layer's features into P consecutive slices. Three layouts of a
(samples, features) activation meet at layer boundaries:
  data    this rank's samples, all features            (n_r, F)
  group   all of the group's samples, all features     (n_g, F)
  model   all of the group's samples, my features      (n_g, f_r)
The calls below move between them, in the training thread, with buffer-based MPI calls on a
communicator of the group's own. `bytes_sent` counts what this rank sends (one copy of its piece to
each peer that needs it), the volume the balance equations speak of (docs/method.md "Balance
equations").
"""
import numpy as np
from mpi4py import MPI

from syncsgd.context import shard_range


class GroupComm:
    def __init__(self, world, groups):
        size, rank = world.Get_size(), world.Get_rank()
        self.groups = groups
        self.size = size // groups              # P, ranks per group
        self.group = rank // self.size          # which group
        self.rank = rank % self.size            # position in the group
        self.world_size = size
        self.comm = world.Split(self.group, rank)
        self.replicas = world.Split(self.rank, rank)   # same position in every group
        self.bytes_sent = 0

    # -- sizes ------------------------------------------------------------------------------
    def sample_counts(self, global_batch):
        """Samples held by each member of this group (their data shards)."""
        first = self.group * self.size
        return [shard_range(global_batch, first + q, self.world_size)[1]
                for q in range(self.size)]

    def feature_counts(self, features):
        return [shard_range(features, q, self.size)[1] for q in range(self.size)]

    @staticmethod
    def _displs(counts):
        return np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)

    def gather_part(self, array, part):
        """The whole parameter from every member's slice `part` (a layers.base.Part) of it;
        every member calls."""
        moved = np.ascontiguousarray(np.moveaxis(array, part.axis, 0))
        rest = moved[0].size if moved.shape[0] else int(np.prod(moved.shape[1:]))
        rows = self.feature_counts(part.total)
        full = np.empty((part.total,) + moved.shape[1:], np.float32)
        counts = [r * rest for r in rows]
        self.comm.Allgatherv(moved, [full, counts, self._displs(counts), MPI.FLOAT])
        return np.moveaxis(full, 0, part.axis)

    # -- data <-> group (samples) -----------------------------------------------------------
    def gather_samples(self, local, out, rows):
        """(n_r, F) -> (n_g, F): everyone gets the group's samples."""
        width = local[0].size if len(local) else out[0].size
        counts = [r * width for r in rows]
        self.comm.Allgatherv(local, [out, counts, self._displs(counts), MPI.FLOAT])
        self.bytes_sent += local.nbytes * (self.size - 1)

    def scatter_sample_sums(self, full, out, rows):
        """(n_g, F) partial sums -> (n_r, F) summed over the group: my samples only."""
        width = full[0].size
        counts = [r * width for r in rows]
        self.comm.Reduce_scatter(full, out, counts, MPI.SUM)
        self.bytes_sent += full.nbytes - out.nbytes

    # -- model <-> group (features) ---------------------------------------------------------
    def gather_features(self, part, out, cols, scratch):
        """(n_g, f_r) -> (n_g, F): everyone gets every feature of the group's samples."""
        n = out.shape[0]
        counts = [n * c for c in cols]
        displs = self._displs(counts)
        self.comm.Allgatherv(np.ascontiguousarray(part), [scratch, counts, displs, MPI.FLOAT])
        _blocks_to_columns(scratch, out, cols, n)
        self.bytes_sent += part.nbytes * (self.size - 1)

    def scatter_feature_sums(self, full, out, cols, scratch):
        """(n_g, F) partial sums -> (n_g, f_r) summed over the group: my features only."""
        n = full.shape[0]
        _columns_to_blocks(full, scratch, cols, n)
        counts = [n * c for c in cols]
        self.comm.Reduce_scatter(scratch, out, counts, MPI.SUM)
        self.bytes_sent += full.nbytes - out.nbytes

    # -- model <-> data ---------------------------------------------------------------------
    def model_to_data(self, part, out, rows, cols, scratch):
        """(n_g, f_r) -> (n_r, F): my samples, every feature (all-to-all in the group)."""
        me = self.rank
        send_counts = [r * cols[me] for r in rows]
        recv_counts = [rows[me] * c for c in cols]
        self.comm.Alltoallv([np.ascontiguousarray(part), send_counts,
                             self._displs(send_counts), MPI.FLOAT],
                            [scratch, recv_counts, self._displs(recv_counts), MPI.FLOAT])
        _blocks_to_columns(scratch, out, cols, rows[me])
        self.bytes_sent += (part.size - rows[me] * cols[me]) * 4

    def data_to_model(self, full, out, rows, cols, scratch):
        """(n_r, F) -> (n_g, f_r): the group's samples, my features (the reverse all-to-all)."""
        me = self.rank
        _columns_to_blocks(full, scratch, cols, rows[me])
        send_counts = [rows[me] * c for c in cols]
        recv_counts = [r * cols[me] for r in rows]
        self.comm.Alltoallv([scratch, send_counts, self._displs(send_counts), MPI.FLOAT],
                            [out, recv_counts, self._displs(recv_counts), MPI.FLOAT])
        self.bytes_sent += (full.size - rows[me] * cols[me]) * 4


def _blocks_to_columns(blocks, out, cols, n):
    """Member-major blocks [(n, c_0), (n, c_1), ...] (flat) -> columns of out (n, sum c)."""
    offset, col = 0, 0
    for c in cols:
        out[:, col:col + c] = blocks[offset:offset + n * c].reshape(n, c)
        offset += n * c
        col += c


def _columns_to_blocks(full, blocks, cols, n):
    offset, col = 0, 0
    for c in cols:
        blocks[offset:offset + n * c].reshape(n, c)[...] = full[:, col:col + c]
        offset += n * c
        col += c
