"""ReLU with Caffe's leaky variant: y = max(x, 0) + negative_slope * min(x, 0).

The plain ReLU (slope 0) runs max(x, 0) forward and dy * (y > 0) backward on pieces shared out
to the thread budget (blas.in_pieces: the mask of a piece stays in cache), faster than
whole-array passes or numexpr's where() (docs/performance.md, "ReLU"); backward is a compiled
loop where Numba runs (kernels/relu.py), numpy's ufuncs otherwise. The leaky form keeps
numexpr.
"""
import numexpr as ne
import numpy as np

from syncsgd.kernels import compiled, relu
from syncsgd.kernels.blas import in_pieces
from syncsgd.layers.base import Fusion
from syncsgd.layers.neuron import NeuronLayer
from syncsgd.layers.registry import register


@register
class ReLU(NeuronLayer):
    type = "ReLU"
    takes_forms = True
    passes_forms = True

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        self.slope = np.float32(self.param.relu_param.negative_slope)
        self._folded_into = None
        self._split = self._split_fusion = self._split_tops = None   # the Split after it

    def absorb(self, follower, bottom, top, follower_bottom, follower_top):
        """The plain ReLU in place: the Split of its top, as after a ResNet's shortcut.
        Backward then adds up the Split's gradients and masks the sum in one pass, instead of a
        pass each (Split.add_gradients); the blob's diff ends as the two passes leave it."""
        if (follower.type != "Split" or self.slope != 0 or top[0] is not bottom[0]
                or follower_bottom[0] is not top[0]):
            return None
        self._split, self._split_fusion, self._split_tops = follower, Fusion(), follower_top
        follower.absorbed_by(self._split_fusion)
        return self._split_fusion

    def folded_into(self, layer):
        """The layer that absorbed this one (a BatchNorm, through the Scale between them, or an
        Eltwise) does its work in its own passes where it says so (relu_folded)."""
        self._folded_into = layer

    def forward(self, bottom, top):
        """In place on a form (blob.py) when the bottom is in one: max(x, 0) keeps its zero
        padding zero."""
        if self._folded_into is not None and self._folded_into.relu_folded():
            return
        form = bottom[0].form(0)
        if form is not None and top[0] is bottom[0] and self._kept_input is None:
            self.compute(form.values, form.values)
            return
        super().forward(bottom, top)

    def backward(self, top, propagate_down, bottom):
        folded = self._folded_into is not None and self._folded_into.relu_folded(backward=True)
        fusion = self._split_fusion
        if fusion is not None and fusion.backward and fusion.sums:
            if propagate_down[0] and not folded and top[0].form(0) is None:
                self._split.add_gradients(self._split_tops, top, mask=top[0].data)
                return
            self._split.add_gradients(self._split_tops, top)
        if folded:
            return
        y, dy = top[0].form(0), top[0].form(1)
        if (propagate_down[0] and top[0] is bottom[0] and self._kept_input is None
                and y is not None and dy is not None and y.same_layout(dy)):
            self.gradient(y.values, y.values, dy.values, dy.values)
            return
        super().backward(top, propagate_down, bottom)

    def needs_input(self):
        # With slope >= 0 the output has the sign of the input, so y tells where x > 0.
        return self.slope < 0

    def compute(self, x, y):
        if self.slope == 0:
            x, y = x.reshape(-1), y.reshape(-1)
            in_pieces(lambda p: np.maximum(x[p], 0, out=y[p]), x.size)   # NaN stays NaN
        else:
            ne.evaluate("where(x > 0, x, x * slope)", local_dict={"x": x, "slope": self.slope},
                        out=y)

    def gradient(self, x, y, dy, dx):
        sign_of = x if self.needs_input() else y
        if self.slope == 0:
            s, dy, dx = sign_of.reshape(-1), dy.reshape(-1), dx.reshape(-1)
            if compiled.available() and dx.ctypes.data == dy.ctypes.data:
                in_pieces(lambda p: relu.gradient_in_place(s[p], dx[p]), dy.size)
            elif compiled.available():
                in_pieces(lambda p: relu.gradient(s[p], dy[p], dx[p]), dy.size)
            else:
                in_pieces(lambda p: np.multiply(dy[p], s[p] > 0, out=dx[p]), dy.size)
        else:
            ne.evaluate("where(s > 0, dy, dy * slope)",
                        local_dict={"s": sign_of, "dy": dy, "slope": self.slope}, out=dx)
