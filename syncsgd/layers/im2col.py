"""Im2col: the columns a convolution multiplies, as a layer, with convolution_param's kernel,
stride, pad and dilation over every axis after the channel axis (convolution_param.axis), as
BVLC's im2col_cpu (2-D) and im2col_nd_cpu (any other number, at least one).

The top is (..., C*k1*...*kN, *out_size), channel c's kernel offset (i1, ..., iN) at channel
index ((c*k1 + i1)*k2 + i2)... (in 2-D (c*kh + i)*kw + j), as in Caffe; the axes before the
channel axis are samples. Backward sums the columns' gradients back over the windows (col2im).
"""
import math

import numpy as np

from syncsgd.kernels.im2col import Im2Col, conv_out_size
from syncsgd.layers.base import Layer
from syncsgd.layers.convolution import spatial_axes, window_geometry
from syncsgd.layers.registry import register


@register
class Im2colLayer(Layer):
    type = "Im2col"
    exact_bottoms = 1
    exact_tops = 1

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        p = self.param.convolution_param
        self.axis, axes = spatial_axes(self, p, bottom[0])
        if axes < 1:
            self.fail(f"needs a spatial axis after the channel axis: convolution_param.axis "
                      f"{p.axis} of bottom {bottom[0].shape} leaves none; set axis to the "
                      f"channel axis (default 1)")
        self.kernel, self.stride, self.pad, self.dilation = window_geometry(self, p, axes)
        self._im2col = None

    def reshape(self, bottom, top):
        shape, axis = bottom[0].shape, self.axis
        if len(shape) != axis + 1 + len(self.kernel):
            self.fail(f"bottom shape {shape} does not fit: expected {axis + 1 + len(self.kernel)} "
                      f"axes as at setup")
        outer = math.prod(shape[:axis])
        channels, size = shape[axis], shape[axis + 1:]
        out = tuple(conv_out_size(*a) for a in zip(size, self.kernel, self.pad, self.stride,
                                                    self.dilation))
        if min(out) <= 0:
            self.fail(f"output size {out} from input {size} is empty: check kernel "
                      f"{self.kernel}, pad {self.pad}, stride {self.stride}, dilation "
                      f"{self.dilation}")
        top[0].reshape(shape[:axis] + (channels * math.prod(self.kernel),) + out)
        key = (channels, size)
        if self._im2col is None or key != self._key:
            self._key = key
            self._im2col = Im2Col(channels, size, self.kernel, self.pad, self.stride,
                                  self.dilation)
        self.images = (outer, channels) + size

    def _as_columns(self, top_array, cols):
        """The top (outer, rows, *out_size) and Im2Col's (rows, outer*pixels) columns, both as
        (rows, outer, pixels)."""
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
