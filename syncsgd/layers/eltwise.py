"""Eltwise: elementwise PROD, SUM (with coefficients) or MAX of bottoms of one shape."""
import numexpr as ne
import numpy as np

from syncsgd.layers.base import Layer
from syncsgd.layers.registry import register
from syncsgd.proto import pb

PROD = pb.EltwiseParameter.PROD
SUM = pb.EltwiseParameter.SUM
MAX = pb.EltwiseParameter.MAX


@register
class Eltwise(Layer):
    type = "Eltwise"
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
        y = top[0].data
        if self.op == PROD:
            np.multiply(bottom[0].data, bottom[1].data, out=y)
            for b in bottom[2:]:
                np.multiply(y, b.data, out=y)
        elif self.op == SUM:
            np.multiply(bottom[0].data, self.coeff[0], out=y)
            for b, c in zip(bottom[1:], self.coeff[1:]):
                ne.evaluate("y + c * x", local_dict={"y": y, "c": c, "x": b.data}, out=y)
        else:
            # Strictly greater replaces, so the first bottom holding the max wins ties.
            np.copyto(y, bottom[0].data)
            self.winner.fill(0)
            for i, b in enumerate(bottom[1:], 1):
                np.greater(b.data, y, out=self.better)
                np.copyto(y, b.data, where=self.better)
                np.copyto(self.winner, i, where=self.better)

    def backward(self, top, propagate_down, bottom):
        dy = top[0].diff
        for i, (b, down) in enumerate(zip(bottom, propagate_down)):
            if not down:
                continue
            dx = b.diff
            if self.op == SUM:
                np.multiply(dy, self.coeff[i], out=dx)
            elif self.op == MAX:
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
