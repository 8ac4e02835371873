"""What a layer may know about the run it is part of, without knowing MPI or the solver.

A net on N ranks processes one slice of each global minibatch. Layers whose result depends on the
whole batch (loss normalisation, accuracy, batch statistics) or on which samples they hold (dropout
masks, shuffling) read it from here, so that every rank computes exactly what one process would.
"""
import numpy as np


_RANDOM_SEED = {"seed": None}


def set_random_seed(seed):
    """pycaffe's caffe.set_random_seed: the seed of what nets made from now on draw (weight
    fillers, dropout, DummyData, shuffling), and of solvers whose random_seed is unset."""
    _RANDOM_SEED["seed"] = int(seed)


def random_seed():
    """The seed set_random_seed last gave, or None."""
    return _RANDOM_SEED["seed"]


class Context:
    def __init__(self, phase, seed=None, rank=0, size=1, allreduce=None):
        self.phase = phase        # syncsgd.TRAIN or syncsgd.TEST
        if seed is None:
            seed = random_seed() or 0
        self.seed = int(seed)     # the solver's random_seed, shared by every rank
        self.rank = rank          # this process's shard of every global batch
        self.size = size          # number of shards
        self.iteration = 0        # forward passes so far (the solver sets it each step)
        self.batch_offset = 0     # global index of this rank's first sample (set by data layers)
        self.global_batch = None  # global minibatch of the current forward (set by data layers)
        self.groups = None        # the model-parallel group (syncsgd.parallel), set by the partitioner
        self._allreduce = allreduce

    def shard(self, global_count):
        """(first, count) of this rank's consecutive slice of `global_count` items."""
        return shard_range(global_count, self.rank, self.size)

    def allreduce_sum(self, array):
        """Sum a small float64 array over all ranks, in place; identity on one process."""
        if self._allreduce is not None and self.size > 1:
            self._allreduce(array)
        return array

    def alone(self):
        """Whether allreduce_sum is the identity (one process): a pass may use its sums at
        once, with no other rank's to wait for."""
        return self._allreduce is None or self.size <= 1

    # Samples over all parts of the batch when known before their sums (lanes.py): None here.
    samples_total = None

    def sum_later(self, array, done):
        """done(allreduce_sum(array)) by the end of the pass, for sums nothing in the pass reads
        (a loss's value, accuracy): at once here; after the lanes' pass in a lane (lanes.py)."""
        done(self.allreduce_sum(array))

    def rng(self, *key):
        """A generator determined by the run seed and `key` (layer name, iteration, ...)."""
        return np.random.Generator(np.random.Philox(key=_key(self.seed, key)))


def shard_range(global_count, rank, size):
    """Rank r gets rows [first, first + count); the first (global_count % size) ranks get one more."""
    base, extra = divmod(global_count, size)
    first = rank * base + min(rank, extra)
    return first, base + (1 if rank < extra else 0)


def _key(seed, parts):
    """A 128-bit Philox key from the seed and a tuple of ints/strings, the same on every rank."""
    words = [int(seed) & 0xFFFFFFFFFFFFFFFF]
    for part in parts:
        if isinstance(part, str):
            words.extend(part.encode())
        else:
            words.append(int(part) & 0xFFFFFFFFFFFFFFFF)
    seq = np.random.SeedSequence(words)
    return seq.generate_state(2, np.uint64)


def uniform_rows(seed, key, first, count, row_size):
    """Uniform [0, 1) float32 values for rows [first, first+count) of a virtual (total, row_size)
    array keyed by (seed, key): row i is the same whatever slice asks for it.

    Philox draws four 64-bit words per counter step, so each row starts on a fresh counter
    (row_size rounded up to a multiple of 4) and `advance` jumps straight to row `first`.
    """
    padded = -(-row_size // 4) * 4
    bitgen = np.random.Philox(key=_key(seed, key))
    bitgen.advance(first * (padded // 4))
    values = np.random.Generator(bitgen).random(count * padded)  # float64: one word per value
    return values.reshape(count, padded)[:, :row_size].astype(np.float32)
