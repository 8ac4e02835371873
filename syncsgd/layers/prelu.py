"""PReLU: max(x, 0) + a * min(x, 0) with a learned slope per channel, or one shared slope."""
import numexpr as ne
import numpy as np

from syncsgd.blob import Blob
from syncsgd.fillers import fill
from syncsgd.layers.base import Layer
from syncsgd.layers.bias import operand_grad
from syncsgd.layers.registry import register
from syncsgd.proto import pb


@register
class PReLULayer(Layer):
    type = "PReLU"
    exact_bottoms = 1
    exact_tops = 1
    in_place_ok = True

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        self._check_axes(bottom[0])
        p = self.param.prelu_param
        channels = bottom[0].shape[1]
        if not self.blobs:
            # Caffe keeps a shared slope in a blob with no axes (one element).
            slope = Blob(() if p.channel_shared else (channels,), name=f"{self.name}.slope")
            filler = p.filler if p.HasField("filler") else pb.FillerParameter(type="constant",
                                                                                value=0.25)
            fill(slope.data, filler, self.ctx.rng(self.name, 0))
            self.blobs.append(slope)
        expected = 1 if p.channel_shared else channels
        if self.blobs[0].count != expected:
            self.fail(f"slope blob has {self.blobs[0].count} values but channel_shared is "
                      f"{p.channel_shared} and bottom has {channels} channels; they must agree")
        self._saved = np.zeros(0, np.float32)
        self._product = np.zeros(0, np.float32)

    def _check_axes(self, blob):
        if blob.num_axes < 2:
            self.fail(f"bottom must have at least 2 axes (num, channels, ...), got {blob.shape}")

    def reshape(self, bottom, top):
        self._check_axes(bottom[0])
        n, channels = bottom[0].shape[:2]
        if not self.param.prelu_param.channel_shared and channels != self.blobs[0].count:
            self.fail(f"bottom has {channels} channels, the slope blob {self.blobs[0].count}")
        count = bottom[0].count
        # A shared slope views the whole input as one "channel"; otherwise (num, channels, rest).
        self._dims = ((1, 1, count) if self.param.prelu_param.channel_shared
                      else (n, channels, count // max(n * channels, 1)))
        if self._product.shape != bottom[0].shape:
            self._product = np.zeros(bottom[0].shape, np.float32)
        if top[0] is bottom[0]:
            if self._saved.shape != bottom[0].shape:
                self._saved = np.zeros(bottom[0].shape, np.float32)
        else:
            top[0].reshape_like(bottom[0])

    def _slope(self):
        return self.blobs[0].data.reshape(1, self._dims[1], 1)

    def forward(self, bottom, top):
        x = bottom[0].data
        if top[0] is bottom[0]:
            np.copyto(self._saved, x)
        ne.evaluate("where(x > 0, x, a * x)", out=top[0].data.reshape(self._dims),
                    local_dict={"x": x.reshape(self._dims), "a": self._slope()})

    def backward(self, top, propagate_down, bottom):
        x = (self._saved if top[0] is bottom[0] else bottom[0].data).reshape(self._dims)
        dy = top[0].diff.reshape(self._dims)
        if self.propagates_param(0):
            product = self._product.reshape(self._dims)
            # Slope gradient before the bottom diff, which in place overwrites the top diff.
            ne.evaluate("where(x > 0, 0, dy * x)", out=product, local_dict={"x": x, "dy": dy})
            operand_grad(self.blobs[0].diff, True, product)
        if propagate_down[0]:
            ne.evaluate("where(x > 0, dy, a * dy)", out=bottom[0].diff.reshape(self._dims),
                        local_dict={"x": x, "dy": dy, "a": self._slope()})
