"""Per-channel passes over a blob's array seen as (sample, channel) rows of its remaining axes,
for BatchNorm's batch statistics and Scale's channel values.

The rows go in blocks that fit a core's cache, shared out to the threads: the several ufuncs a
pass makes on a block then read memory about once between them (numexpr's one call over the
whole array ran at half the rate), and a row's values do not depend on which thread, or which
block, took it. Per-channel values go in as one value per row.

Sums over a channel go in two steps: each row in float32 without writing products (numpy's
pairwise sum; einsum's dot product, which unlike BLAS's does not depend on the thread count),
then the rows of a channel in float64. A rank holding some of the samples sums their rows as
one process does, so the totals of N ranks are those of one process but for float64 rounding.
"""
import numpy as np

from syncsgd.kernels.blas import spread

BLOCK = 1 << 18       # values of a block of rows (1 MiB of each array it reads)
# Values of a block of channels over every sample (3 MiB of each array it reads): a pass that
# reads the block twice, the channels' sums between, finds it in the cache the second time
# (docs/performance.md, "BatchNorm in blocks of channels").
CHANNEL_BLOCK = 3 << 18


class Rows:
    """The rows of arrays of `shape` (axis 1 the channels; 1 channel for one axis), with
    `buffers` per-row value buffers, numbered from 0."""

    def __init__(self, shape, buffers):
        self.of = tuple(shape)
        n = shape[0]
        channels = shape[1] if len(shape) > 1 else 1
        count = int(np.prod(shape))
        self.shape = (n * channels, count // max(n * channels, 1))
        step = max(1, BLOCK // max(self.shape[1], 1))
        self._blocks = [(lo, min(lo + step, self.shape[0]))
                        for lo in range(0, self.shape[0], step)]
        self._values = np.zeros((buffers, n, channels), np.float32)
        # At least eight blocks of channels (where there are as many), for the threads to
        # share evenly.
        step = max(1, min(CHANNEL_BLOCK // max(n * self.shape[1], 1), -(-channels // 8)))
        self._channel_blocks = [(c, min(c + step, channels)) for c in range(0, channels, step)]

    def run(self, work):
        """work(lo, hi) for every block of rows, on the threads."""
        spread(self._blocks, lambda block, worker: work(*block))

    def run_channels(self, work):
        """work(c0, c1) for every block of channels (the rows of those channels of every
        sample), on the threads."""
        spread(self._channel_blocks, lambda block, worker: work(*block))

    def per_row(self, k, channel_values):
        """Per-channel values as one per row, (rows, 1), in buffer k."""
        rows = self._values[k]
        rows[...] = channel_values
        return rows.reshape(-1, 1)

    def flat(self, k):
        """Buffer k as it stands, one value per row, flat."""
        return self._values[k].reshape(-1)

    def sums(self, k, a, lo, hi):
        """Buffer k's rows lo:hi = the sums of those rows of `a` (a (rows, length) array)."""
        np.sum(a[lo:hi], axis=1, out=self._values[k].reshape(-1)[lo:hi])

    def dots(self, k, a, b, lo, hi):
        """Buffer k's rows lo:hi = the dot products of those rows of `a` and `b`."""
        np.einsum("ij,ij->i", a[lo:hi], b[lo:hi], out=self._values[k].reshape(-1)[lo:hi])

    def totals(self, k):
        """Buffer k's rows summed per channel, in float64."""
        return self._values[k].sum(axis=0, dtype=np.float64)
