"""Im2col: the columns a convolution multiplies, as a layer, with convolution_param's kernel,
stride, pad and dilation.

The top is (N, C*kh*kw, out_h, out_w), channel c's kernel offset (i, j) at channel index
(c*kh + i)*kw + j, as in Caffe; backward sums the columns' gradients back over the windows
(col2im). Two spatial axes after convolution_param.axis are supported (Caffe's N-D im2col
is not).
"""
import numpy as np

from syncsgd.kernels.im2col import Im2Col, conv_out_size
from syncsgd.layers.base import Layer, canonical_axis
from syncsgd.layers.convolution import window_geometry
from syncsgd.layers.registry import register


@register
class Im2colLayer(Layer):
    type = "Im2col"
    exact_bottoms = 1
    exact_tops = 1

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        p = self.param.convolution_param
        self.axis = canonical_axis(p.axis, bottom[0].num_axes, self)
        if bottom[0].num_axes - self.axis != 3:
            self.fail(f"needs two spatial axes after the channel axis: convolution_param.axis "
                      f"{p.axis} of a {bottom[0].num_axes}-axis bottom leaves "
                      f"{bottom[0].num_axes - self.axis - 1}")
        self.kernel, self.stride, self.pad, self.dilation = window_geometry(self, p)
        self._im2col = None

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        if len(shape) != self.axis + 3:
            self.fail(f"bottom shape {shape} does not fit: expected {self.axis + 3} axes as at "
                      f"setup")
        outer = int(np.prod(shape[:self.axis], dtype=np.int64))
        channels, size = shape[self.axis], shape[self.axis + 1:]
        out = tuple(conv_out_size(*a) for a in zip(size, self.kernel, self.pad, self.stride,
                                                    self.dilation))
        if min(out) <= 0:
            self.fail(f"output size {out} from input {size} is empty: check kernel "
                      f"{self.kernel}, pad {self.pad}, stride {self.stride}, dilation "
                      f"{self.dilation}")
        rows = channels * self.kernel[0] * self.kernel[1]
        top[0].reshape(shape[:self.axis] + (rows,) + out)
        key = (channels, size)
        if self._im2col is None or key != self._key:
            self._key = key
            self._im2col = Im2Col(channels, size, self.kernel, self.pad, self.stride,
                                  self.dilation)
        self.images = (outer, channels) + size

    def _as_columns(self, top_array, cols):
        """The top (outer, rows, out_h, out_w) and Im2Col's (rows, outer*pixels) columns, both
        as (rows, outer, pixels)."""
        k, outer = self._im2col, self.images[0]
        return (top_array.reshape(outer, k.rows, k.pixels).transpose(1, 0, 2),
                cols.reshape(k.rows, outer, k.pixels))

    def forward(self, bottom, top):
        cols = self._im2col.im2col(bottom[0].data.reshape(self.images))
        np.copyto(*self._as_columns(top[0].data, cols))

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        cols = self._im2col.columns(self.images[0])
        top_diff, columns = self._as_columns(top[0].diff, cols)
        np.copyto(columns, top_diff)
        self._im2col.col2im(cols, bottom[0].diff.reshape(self.images))
