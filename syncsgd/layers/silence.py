"""Silence: consumes blobs nobody else uses, so the net does not report them as outputs."""
from syncsgd.layers.base import Layer
from syncsgd.layers.registry import register


@register
class Silence(Layer):
    type = "Silence"
    min_bottoms = 1
    exact_tops = 0

    def setup(self, bottom, top):
        self.check_counts(bottom, top)

    def reshape(self, bottom, top):
        pass

    def forward(self, bottom, top):
        pass

    def backward(self, top, propagate_down, bottom):
        for b, down in zip(bottom, propagate_down):
            if down:
                b.diff.fill(0)
