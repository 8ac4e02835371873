"""Per-channel normalisation passes on oneDNN (onednn.Normalization) for the Scale layer and for
BatchNorm with stored statistics, on a blob's values where they are: in its form's layout
(blob.py) or as its array.

Why: ResNets put a BatchNorm and a Scale after every convolution. On numpy each took several
passes over the maps, and because they did not take forms, every convolution's maps went out
of oneDNN's layout and back (docs/performance.md, "BatchNorm, Scale, Eltwise and Split"). Here
each layer is one pass each way, in the layout the convolution left.

A layer in place still needs its input for backward. On a form nothing is copied: the layer's
output goes into a form it holds, the blob takes that one, and the layer holds the input's
form until its next forward (each form has one owner: its blob or one layer). On an array the
input is copied first, as Caffe's in-place layers do.
"""
import numpy as np

from syncsgd.kernels import onednn
from syncsgd.kernels.scratch import scratch


def usable(blob):
    """Whether oneDNN can normalise `blob`'s channels (axis 1 of 2 to 5 axes)."""
    if not 2 <= blob.num_axes <= 5 or blob.count == 0:
        return False
    try:
        onednn.library()
    except onednn.Unavailable:
        return False
    return True


class ChannelNormalization:
    """One layer's passes: ChannelNormalization(eps, scale, shift) as in onednn.Normalization;
    `vectors` are what its forward or backward takes after the values: (mean, variance[,
    scale[, shift]]) forward, (mean, variance[, scale, diff_scale, diff_shift]) backward."""

    def __init__(self, eps, scale, shift):
        self._config = (eps, scale, shift)
        self._built = []        # the primitives of the last two (shape, layout) pairs
        self._input = None      # in place: forward's input (a Form, or a copy of the array)

    def _primitives(self, shape, md):
        for built in self._built:
            if built.fits(shape, md):
                return built
        built = onednn.Normalization(shape, md, *self._config)
        self._built = self._built[-1:] + [built]
        return built

    def forward(self, bottom, top, *vectors):
        form, shape = bottom.form(0), bottom.shape
        in_place = top is bottom
        if form is not None and (in_place or top.takes_forms):
            out = self._input if in_place else onednn.form_like(top, 0, form)
            if not isinstance(out, onednn.Form) or not out.same_layout(form):
                out = onednn.Form(shape, form.md)
            self._primitives(shape, form.md).forward(form.values, out.values, *vectors)
            top.keep(0, out)
            self._input = form if in_place else None
            return
        x = bottom.data
        if in_place:
            if not isinstance(self._input, np.ndarray) or self._input.shape != x.shape:
                self._input = np.empty_like(x)
            np.copyto(self._input, x)
            y, x = x, self._input
        else:
            y, self._input = top.overwrite(0), None
        self._primitives(shape, None).forward(x, y, *vectors)

    def backward(self, top, bottom, propagate, *vectors):
        """The input's gradient into bottom's diff when `propagate` (else discarded), and the
        scale's and shift's into the diff_scale and diff_shift vectors."""
        shape = bottom.shape
        x = self._input if top is bottom else bottom.form(0)
        if x is None:
            x = bottom.data
        dy = top.form(1)
        if isinstance(x, onednn.Form) and dy is not None and dy.fits(shape, x.md):
            if not propagate:
                dx = scratch("normalization_grad", (dy.values.size,))
            elif top is bottom:
                dx = dy.values
            else:
                out = onednn.form_like(bottom, 1, dy)
                dx = out.values
            self._primitives(shape, x.md).backward(x.values, dy.values, dx, *vectors)
            if propagate and top is not bottom:
                bottom.keep(1, out)
            return
        if isinstance(x, onednn.Form):
            plain = scratch("normalization_input", shape)
            x.to_plain(plain)
            x = plain
        dy = top.diff
        if not propagate:
            dx = scratch("normalization_grad", shape)
        else:
            dx = dy if top is bottom else bottom.overwrite(1)
        self._primitives(shape, None).backward(x, dy, dx, *vectors)
