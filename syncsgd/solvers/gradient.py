"""What every update rule shares: the gradient it consumes and the step it applies, each fused
into the rule's own numexpr passes so that a parameter slice is read a few times and no full-size
temporary is made (issue 7: the update is memory-bound).

Caffe's ApplyUpdate goes over a parameter five times: diff /= iter_size, diff += decay * data,
history = f(history, diff), diff = step, data -= diff. Here a rule writes `{grad}` in its
expressions wherever Caffe's regularised gradient stands; it expands to
`scale * diff + decay * data` (L2) or `... + decay * sign(data)` (L1), read from diff and data
in the same pass that updates the history. `Gradient.step` then subtracts the step from the
weights in one more pass. For SGD that is two passes in all:

    history = momentum * history + rate * (scale * diff + decay * data)
    data = data - history
"""
import numexpr as ne
import numpy as np

from syncsgd.errors import PrototxtError

# The regularisation terms, added to the scaled diff. L1's sign(data): numexpr's sign() returns
# float64 (and is missing before numexpr 2.10); data / abs(data) is exactly +-1, and 0 stays 0.
_DECAY_TERMS = {"L2": "decay * data", "L1": "where(data != 0, decay * (data / abs(data)), 0)"}


def gradient_term(scale, decay, kind, source="<solver>"):
    """The numexpr text of the gradient an update rule uses: the accumulated diff times `scale`
    (1 / iter_size, times the clipping factor) plus the weight decay of type `kind`."""
    term = "diff" if scale == 1 else "scale * diff"
    if not decay:
        return f"({term})"
    if kind not in _DECAY_TERMS:
        raise PrototxtError(f"{source}: unknown regularization_type '{kind}'; use L2 or L1")
    return f"({term} + {_DECAY_TERMS[kind]})"


class Gradient:
    """One parameter slice (diff and data, flat views) as an update rule sees it.

    `keep_step`: leave the applied step in diff afterwards, as Caffe does, for snapshot_diff and
    debug_info; otherwise the step goes straight into data and diff keeps the gradient that
    backward accumulated (one pass fewer)."""

    def __init__(self, diff, data, term, scale, decay, keep_step):
        self.diff = diff
        self.data = data
        self.term = term
        self.keep_step = keep_step
        self.names = {"diff": diff, "data": data, "scale": np.float32(scale),
                      "decay": np.float32(decay)}

    def evaluate(self, expression, out, **names):
        """Write the numexpr `expression` into `out`; {grad} in it stands for the gradient and
        `names` gives its other variables (float32 scalars keep the pass in float32)."""
        assert not names.keys() & self.names.keys(), f"{sorted(names)} hides a gradient name"
        ne.evaluate(expression.format(grad=self.term), local_dict={**self.names, **names},
                    out=out, casting="same_kind")

    def step(self, expression, **names):
        """data -= the step that `expression` computes. The step may still read {grad}: each
        element of data is read before it is written."""
        if self.keep_step:
            self.evaluate(expression, self.diff, **names)
            self.evaluate("data - diff", self.data)
        else:
            self.evaluate(f"data - ({expression})", self.data, **names)
