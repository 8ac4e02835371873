"""DummyData: tops filled by fillers, for tests and timing runs without a data source.

The first dimension of every top is the global batch: each rank gets its consecutive slice of
rows, and random values are drawn for the whole global blob from a generator keyed by the layer
name and iteration, so a run is repeatable and the same on any number of ranks.
"""
import numpy as np

from syncsgd.blob import check_shape
from syncsgd.fillers import fill
from syncsgd.layers.base import Layer
from syncsgd.layers.input import shape_for
from syncsgd.layers.registry import register
from syncsgd.proto import pb

LEGACY = ("num", "channels", "height", "width")


@register
class DummyData(Layer):
    type = "DummyData"
    exact_bottoms = 0
    min_tops = 1

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        p = self.param.dummy_data_param
        n = len(top)
        if len(p.data_filler) not in (0, 1, n):
            self.fail(f"{len(p.data_filler)} data_filler(s) for {n} tops; give none (zeros), "
                      f"one for all tops, or one per top")
        zero = pb.FillerParameter(type="constant", value=0)
        self.fillers = [p.data_filler[0 if len(p.data_filler) == 1 else i] if p.data_filler
                        else zero for i in range(n)]
        shapes = [self._shape(p, i, n) for i in range(n)]
        for t, shape in zip(top, shapes):
            check_shape(shape, t.name)
        self.buffers = [np.empty(shape, np.float32) for shape in shapes]
        for t, buffer in zip(top, self.buffers):
            t.reshape(buffer[self._rows(buffer)].shape)
        self.refill = [f.type != "constant" for f in self.fillers]
        self._fill(top, [not r for r in self.refill], self.ctx.rng(self.name))

    def _shape(self, p, i, n):
        legacy = [getattr(p, f) for f in LEGACY]
        if any(legacy):
            if p.shape:
                self.fail("give either shape or num/channels/height/width, not both")
            if any(len(values) not in (1, n) for values in legacy):
                self.fail(f"num, channels, height and width must each be given once, or once "
                          f"per top ({n})")
            return tuple(values[0 if len(values) == 1 else i] for values in legacy)
        if len(p.shape) not in (1, n):
            self.fail(f"{len(p.shape)} shape(s) for {n} tops; give one shape for all tops or "
                      f"one per top")
        return shape_for(p.shape, i)

    def _rows(self, buffer):
        """Index of this rank's rows of a global blob."""
        if buffer.ndim == 0:
            return ()
        first, count = self.ctx.shard(buffer.shape[0])
        return slice(first, first + count)

    def _fill(self, top, which, rng):
        for t, buffer, filler, wanted in zip(top, self.buffers, self.fillers, which):
            if wanted:
                fill(buffer, filler, rng)
                np.copyto(t.data, buffer[self._rows(buffer)])

    def reshape(self, bottom, top):
        """Shapes are fixed at setup; later layers learn which global samples this rank holds."""
        if self.buffers and self.buffers[0].ndim:
            global_batch = self.buffers[0].shape[0]
            self.ctx.batch_offset = self.ctx.shard(global_batch)[0]
            self.ctx.global_batch = global_batch

    def forward(self, bottom, top):
        if any(self.refill):
            self._fill(top, self.refill, self.ctx.rng(self.name, self.ctx.iteration))
