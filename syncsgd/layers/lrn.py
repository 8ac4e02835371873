"""LRN (local response normalisation): top = x * s^-beta, s = k + alpha / D * (window sum of x^2).

ACROSS_CHANNELS: the window is `local_size` neighbouring channels, D = local_size.
WITHIN_CHANNEL: Caffe composes it from average pooling (zero padded, the divisor always the full
window) and a power layer, which comes to the same form with a local_size x local_size spatial
window, D = local_size^2 and k = 1.
Both windows are centred and zero padded, hence symmetric, so backward reuses the same window sum:
dx = dy * s^-beta - (2 alpha beta / D) * x * (window sum of dy * y / s).
The batch runs in parts of a few samples shared out to the thread budget, each part through all
the steps while it is in the cache (one pass over memory instead of one per step: "LRN: parts"
in docs/performance.md); a part's window sum reads shifted views of a zero-bordered buffer of
its thread. s^-beta is kept for backward; for beta 0.75 (every model-zoo net) it is
1 / sqrt(s * sqrt(s)), vectorised square roots instead of exp and log. Across channels, where
Numba is available (kernels/compiled.py), each part runs as two compiled loops instead
(kernels/lrn.py), which give the same values forward in one read of the part ("LRN:
compiled").

On a blob in a form's layout (blob.py), as AlexNet's and GoogLeNet's convolutions and ReLUs leave
them, it runs as oneDNN's LRN in that layout, where oneDNN has JIT kernels for it both ways (the
channel-blocked layouts on AVX-512): no reorder to NCHW and back around the layer. Elsewhere
oneDNN has only its reference kernel, slower than the passes here ("LRN: parts").
"""
import numpy as np

from syncsgd.blob import check_shape
from syncsgd.kernels import compiled, onednn
from syncsgd.kernels import lrn as compiled_lrn
from syncsgd.kernels.blas import spread
from syncsgd.kernels.plans import THRESHOLDS
from syncsgd.kernels.scratch import scratch
from syncsgd.kernels.threads import budget
from syncsgd.layers.base import Layer
from syncsgd.layers.registry import register
from syncsgd.proto import pb


def _along(axis, start, stop):
    return (slice(None),) * axis + (slice(start, stop),)


@register
class LRNLayer(Layer):
    sample_wise = True
    type = "LRN"
    exact_bottoms = 1
    exact_tops = 1
    takes_forms = True
    passes_forms = True
    thresholds = THRESHOLDS     # may be replaced per layer (tests force parts)

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        p = self.param.lrn_param
        self._size = p.local_size
        if self._size % 2 != 1:
            self.fail(f"lrn_param.local_size is {self._size}; LRN supports odd sizes only")
        self._pad = (self._size - 1) // 2
        if p.norm_region == pb.LRNParameter.ACROSS_CHANNELS:
            self._axes = (1,)
            divisor, self._k = self._size, np.float32(p.k)
        else:
            self._axes = (2, 3)
            divisor, self._k = self._size * self._size, np.float32(1.0)
        self._alpha_over_d = np.float32(p.alpha / divisor)
        self._grad_coef = np.float32(2.0 * p.alpha * p.beta / divisor)
        self._neg_beta = np.float32(-p.beta)
        self._beta = np.float32(p.beta)
        self._shape = None
        self._compiled = self._axes == (1,) and compiled.available()
        self._onednn = None         # (a Layout, oneDNN's LRN in it or None, a Layout for dy)
        self._ran_onednn = False

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        if len(shape) != 4:
            self.fail(f"bottom must have 4 axes (num, channels, height, width), got {shape}")
        top[0].reshape(shape)
        if shape != self._shape:
            self._shape = shape
            self._scale = np.zeros(shape, np.float32)   # s, kept for backward
            # s^-beta, kept for backward by the numpy passes (the compiled ones make it again).
            self._power = None if self._compiled else np.zeros(shape, np.float32)
            for axis in self._axes:
                padded = list(shape)
                padded[axis] += self._size - 1
                check_shape(tuple(padded), f"{self.name} window (lrn_param.local_size "
                            f"{self._size})")
            sample = max(1, shape[1] * shape[2] * shape[3])
            part = max(1, self.thresholds.lrn_part_values // sample)
            self._parts = [slice(n, min(n + part, shape[0])) for n in range(0, shape[0], part)]

    def _each_part(self, work):
        if self._parts:
            spread(self._parts, lambda part, worker: work(part), budget())

    def _window_sum(self, values, out):
        """out = the zero-padded centred window sum of `values` (a part), along each window
        axis in turn through zero-bordered buffers of this thread; out may be values."""
        for axis in self._axes:
            length = values.shape[axis]
            shape = list(values.shape)
            shape[axis] += self._size - 1
            padded = scratch(f"lrn_{axis}", shape)
            padded[_along(axis, 0, self._pad)] = 0
            padded[_along(axis, self._pad + length, None)] = 0
            padded[_along(axis, self._pad, self._pad + length)] = values
            np.copyto(out, padded[_along(axis, 0, length)])
            for offset in range(1, self._size):
                out += padded[_along(axis, offset, offset + length)]
            values = out

    def _kernel(self, form):
        """oneDNN's LRN for values in `form`'s layout where its kernels are JIT both ways, else
        None."""
        if self._onednn is None or not self._onednn[0].fits(form.shape, form.md):
            p = self.param.lrn_param
            try:
                kernel = onednn.LRN(form.shape, form.md, self._axes != (1,), self._size,
                                    p.alpha, p.beta, self._k)
            except onednn.Unavailable:
                kernel = None
            if kernel is not None and any(name.startswith("ref") for name in kernel.kernels):
                kernel = None
            layout = onednn.Layout(form.shape, form.md)
            self._onednn = (layout, kernel,
                            onednn.Layout(form.shape, form.md) if kernel is not None else None)
        return self._onednn[1]

    def forward(self, bottom, top):
        form = bottom[0].form(0)
        kernel = self._kernel(form) if form is not None and top[0].takes_forms else None
        self._ran_onednn = kernel is not None
        if kernel is not None:
            out = onednn.form_like(top[0], 0, form)
            kernel.forward(form.values, out.values)
            top[0].keep(0, out)
            return
        x, y = bottom[0].data, top[0].data
        if self._compiled:
            x3, y3, s3 = (a.reshape(a.shape[0], a.shape[1], -1) for a in (x, y, self._scale))
            self._each_part(lambda part: compiled_lrn.forward(
                x3[part], y3[part], s3[part], self._size, self._alpha_over_d, self._k,
                self._beta))
            return

        def work(part):
            s, power = self._scale[part], self._power[part]
            np.multiply(x[part], x[part], out=s)
            self._window_sum(s, s)
            s *= self._alpha_over_d
            s += self._k
            if self._beta == 0.75:
                np.sqrt(s, out=power)
                power *= s
                np.sqrt(power, out=power)
                np.reciprocal(power, out=power)
            else:
                np.log(s, out=power)
                power *= self._neg_beta
                np.exp(power, out=power)
            np.multiply(x[part], power, out=y[part])
        self._each_part(work)

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        if self._ran_onednn:
            # Operands in the forward's layout: their forms as they are, or reordered into it.
            layout, kernel, diff_layout = self._onednn
            x, dy = layout.take(bottom[0], 0), diff_layout.take(top[0], 1)
            out = onednn.form_like(bottom[0], 1, layout)
            kernel.backward(x, dy, out.values)
            bottom[0].keep(1, out)
            return
        dy, y, x, dx = top[0].diff, top[0].data, bottom[0].data, bottom[0].diff
        if self._compiled:
            dy3, y3, x3, dx3, s3 = (a.reshape(a.shape[0], a.shape[1], -1)
                                    for a in (dy, y, x, dx, self._scale))
            self._each_part(lambda part: compiled_lrn.backward(
                x3[part], y3[part], s3[part], dy3[part], dx3[part],
                scratch("lrn_work", x3.shape[1:]), self._size, self._grad_coef, self._beta))
            return

        def work(part):
            w = scratch("lrn_work", dy[part].shape)
            np.multiply(dy[part], y[part], out=w)
            w /= self._scale[part]
            self._window_sum(w, w)
            w *= x[part]
            w *= self._grad_coef
            np.multiply(dy[part], self._power[part], out=dx[part])
            dx[part] -= w
        self._each_part(work)
