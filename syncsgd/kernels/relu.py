"""The plain ReLU's gradient as a compiled loop (kernels/compiled.py): dx = dy * (y > 0), the
mask a select inside the loop, where numpy writes a boolean mask and multiplies by it, which
cost 2.4x a plain multiply (docs/performance.md, "ReLU"). It multiplies by 1 or 0 as numpy
does, so a negative dy where y <= 0 gives -0 and an infinite one NaN: numpy's values to the
bit. In place (dx is dy, as in every net's ReLU) it has a loop of its own: where dx and dy are
two arguments that may overlap, the compiled loop checks at run time and, finding them one
array, runs unvectorised at half numpy's speed. An Eltwise SUM of two arrays with the ReLU after
it absorbed clamps its sum in the same loop (clamped_sum), and a ReLU that absorbed the Split
after it masks the sum of the Split's two gradients in one (masked_sum)."""
from syncsgd.kernels.compiled import kernel


@kernel
def gradient(sign_of, dy, dx):
    """dx = dy * (sign_of > 0), flat arrays of one length, dx not dy."""
    for i in range(dy.size):
        dx[i] = dy[i] * (1.0 if sign_of[i] > 0 else 0.0)


@kernel
def gradient_in_place(sign_of, d):
    """d *= (sign_of > 0), flat arrays of one length."""
    for i in range(d.size):
        d[i] = d[i] * (1.0 if sign_of[i] > 0 else 0.0)


@kernel
def clamped_sum(a, b, y):
    """y = max(a + b, 0) as numpy's maximum gives it (NaN stays NaN, -0 becomes 0), flat
    arrays of one length, y not a or b."""
    for i in range(y.size):
        v = a[i] + b[i]
        y[i] = 0.0 if v <= 0 else v


@kernel
def masked_sum(a, b, sign_of, dx):
    """dx = (a + b) * (sign_of > 0): the sum in float32, then the mask as `gradient` applies
    it; flat arrays of one length, dx none of the others."""
    for i in range(dx.size):
        dx[i] = (a[i] + b[i]) * (1.0 if sign_of[i] > 0 else 0.0)
