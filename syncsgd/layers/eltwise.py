"""Eltwise: elementwise PROD, SUM (with coefficients) or MAX of bottoms of one shape.

SUM (a ResNet's shortcut) takes forms: where a bottom is in a form it sums in that form's
layout (the others reordered into it where theirs differs) into a form of the top, and hands
the gradient back in that layout, so the convolutions around it reorder less (blob.py)."""
import numexpr as ne
import numpy as np

from syncsgd.kernels.elementwise import scaled_copies, weighted_sum
from syncsgd.kernels.onednn import Gather, form_like
from syncsgd.layers.base import Fusion, Layer
from syncsgd.layers.registry import register
from syncsgd.proto import pb

PROD = pb.EltwiseParameter.PROD
SUM = pb.EltwiseParameter.SUM
MAX = pb.EltwiseParameter.MAX


@register
class Eltwise(Layer):
    type = "Eltwise"
    passes_forms = True
    min_bottoms = 2
    exact_tops = 1

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        p = self.param.eltwise_param
        self.op = p.operation
        if p.coeff and len(p.coeff) != len(bottom):
            self.fail(f"{len(p.coeff)} coeff value(s) for {len(bottom)} bottoms; give one per "
                      f"bottom or none")
        if p.coeff and self.op != SUM:
            self.fail("coeff applies to operation SUM only")
        self.coeff = [np.float32(c) for c in p.coeff] or [np.float32(1)] * len(bottom)
        self.stable_prod_grad = p.stable_prod_grad
        self.winner = None
        self.takes_forms = self.forms_for(self.param, self.ctx.phase)
        self._gather = Gather()
        self._relu_fusion = None        # with the ReLU after it (absorb)
        self._relu_done = False

    def absorb(self, follower, bottom, top, follower_bottom, follower_top):
        """SUM: the plain ReLU in place on the top, as after a ResNet's shortcut. Forward on
        arrays then clamps each piece of the sum while it is in cache, a pass less; backward
        stays the ReLU's, which writes the masked gradient where users look for it."""
        if (self.op != SUM or follower.type != "ReLU" or follower.slope != 0
                or follower_bottom[0] is not top[0] or follower_top[0] is not top[0]):
            return None
        self._relu_fusion = Fusion()
        follower.folded_into(self)
        return self._relu_fusion

    def relu_folded(self, backward=False):
        """Whether the last forward did the absorbed ReLU's (the ReLU's backward is its own)."""
        return not backward and self._relu_done and self._relu_fusion.forward

    @classmethod
    def forms_for(cls, param, phase):
        return param.eltwise_param.operation == SUM

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        for i, b in enumerate(bottom[1:], 1):
            if b.shape != shape:
                self.fail(f"bottom {i} has shape {b.shape}, bottom 0 {shape}: all must agree")
        top[0].reshape(shape)
        if self.op == MAX and (self.winner is None or self.winner.shape != shape):
            self.winner = np.empty(shape, np.int32)    # which bottom gave the max
            self.better = np.empty(shape, bool)

    def forward(self, bottom, top):
        self._relu_done = False
        like, values = (self._gather.values(bottom, 0) if self.op == SUM and top[0].takes_forms
                        else (None, None))
        if like is not None:
            out = form_like(top[0], 0, like)
            weighted_sum(values, self.coeff, out.values)
            top[0].keep(0, out)
            return
        y = top[0].data
        if self.op == PROD:
            np.multiply(bottom[0].data, bottom[1].data, out=y)
            for b in bottom[2:]:
                np.multiply(y, b.data, out=y)
        elif self.op == SUM:
            self._relu_done = self._relu_fusion is not None and self._relu_fusion.forward
            weighted_sum([b.data for b in bottom], self.coeff, y, relu=self._relu_done)
        else:
            # Strictly greater replaces, so the first bottom holding the max wins ties.
            np.copyto(y, bottom[0].data)
            self.winner.fill(0)
            for i, b in enumerate(bottom[1:], 1):
                np.greater(b.data, y, out=self.better)
                np.copyto(y, b.data, where=self.better)
                np.copyto(self.winner, i, where=self.better)

    def backward(self, top, propagate_down, bottom):
        targets = [(b, c) for b, c, d in zip(bottom, self.coeff, propagate_down) if d]
        coeffs = [c for _, c in targets]
        dy = top[0].form(1) if self.op == SUM else None
        if dy is not None and all(b.takes_forms for b in bottom):
            outs = [form_like(b, 1, dy) for b, _ in targets]
            scaled_copies(dy.values, coeffs, [out.values for out in outs])
            for (b, _), out in zip(targets, outs):
                b.keep(1, out)
            return
        dy = top[0].diff
        if self.op == SUM:
            # A bottom whose gradient is the top's and whose diff no later backward writes (no
            # layer in place on it: a ResNet's identity shortcut) shares the top's diff, as
            # Caffe's ShareDiff, instead of a copy; a Split before it reads the sum it holds.
            kept = dict(zip(map(id, bottom), self.bottoms_kept))
            copies = [(b, c) for b, c in targets
                      if not (c == 1 and kept.get(id(b)) and b is not top[0]
                              and b.share_diff(top[0]))]
            scaled_copies(dy, [c for _, c in copies], [b.overwrite(1) for b, _ in copies])
            return
        for i, (b, down) in enumerate(zip(bottom, propagate_down)):
            if not down:
                continue
            dx = b.diff
            if self.op == MAX:
                np.equal(self.winner, i, out=self.better)
                np.multiply(dy, self.better, out=dx)
            elif self.stable_prod_grad:
                others = [o for j, o in enumerate(bottom) if j != i]
                np.multiply(dy, others[0].data, out=dx)
                for o in others[1:]:
                    np.multiply(dx, o.data, out=dx)
            else:
                ne.evaluate("dy * y / x", local_dict={"dy": dy, "y": top[0].data, "x": b.data},
                            out=dx)

