"""Pooling: MAX and AVE over 2-D windows of (N, C, H, W) blobs, with Caffe's output-size rules.

kernels.plans.plan_pooling picks the kernel per geometry: oneDNN's pooling (onednn.Pooling, on
channel-blocked copies) where it computes Caffe's result, else the numpy kernels below, which
also run every layer with engine CAFFE. oneDNN passes over NaN as Caffe does; a MAX output of
-FLT_MAX or less (a window holding nothing Caffe selects) or NaN (a safety net) makes the oneDNN
kernel redo that forward pass on numpy (the plan's fallback), and backward follows the pass that
ran.

Both methods are separable and run in two stages: along each window row (kw column offsets),
then down the window (kh rows of those results): kh + kw operations per output instead of
kh * kw.

Layout. numpy is fast on long contiguous runs and several times slower on views whose rows are
a few values long, so every operation here runs over whole runs of a part of the batch:
- the image is split by column phase (column modulo stride_w) into column planes, padded with a
  value that never changes the result (-FLT_MAX for MAX, 0 for AVE). Column offset j of window
  column px then lies in plane j % sw at px + j // sw: a constant shift of the flattened planes.
  When the image's width is a multiple of the stride and there is no padding, a plane is the
  image's own phase, copied by one strided copy; a window hanging over the right edge then reads
  the next row's first columns, which are set to the neutral value once the offsets that need
  them are done (`_wraps`). Otherwise the planes have padding columns around the image;
- the first stage's results are split by row phase into row planes padded the same way (whole
  rows, copied as single elements, see _rows_of), a (depth, width) grid per image plane, where
  kernel row i of window row py lies in plane i % sh at row py + i // sh: again a constant
  shift, and the second stage runs over the part's grids in one run. With stride 1 and no
  padding the first stage's results are the row plane.
Grid rows and columns past the last window are computed and never read (junk). The planes and
intermediate results live in buffers all layers share (kernels/scratch.py); the batch is
processed in parts that fit the cache (the plan's part), shared out to the budget's threads.

MAX keeps Caffe's rule, the first maximum in raster order (strict >): the first stage keeps, per
window row, its maximum and the column offset of the first maximum (a code); the second keeps
the first row whose maximum is the window's, carrying that row's column code along. The window's
maximum first appears in that row, at that column, so the pair is Caffe's argmax; the layer
keeps it as the flat offset i * W + j from the window's start (two bytes per output), and
backward adds each gradient at window start + offset in one np.add.at (windows that share pixels
add up), faster than routing the gradients back through both stages by their codes. AVE's
backward does that (sums), then gathers the planes back into the image. A window covering the
whole image (global pooling) uses numpy's reductions instead.

Values Caffe never selects (NaN, and anything not above -FLT_MAX) are checked for after the fact:
the plain comparisons pass NaN on to the output, so if a part's output holds NaN or -FLT_MAX or
less, its image is clamped to -FLT_MAX (fmax, which drops NaN) and the part recomputed. A window
holding no value above -FLT_MAX (also one of only padding, possible in ceil mode when
stride > kernel) then gives -FLT_MAX, mask -1 and no gradient, as in Caffe. AVE gives 0 there
(where Caffe would divide 0 by a window size of 0).
"""
import math

import numpy as np

from syncsgd.blob import Side
from syncsgd.kernels import onednn
from syncsgd.kernels.blas import spread
from syncsgd.kernels.im2col import inside
from syncsgd.kernels.plans import THRESHOLDS, PoolingGeometry, choose, plan_pooling
from syncsgd.kernels.scratch import scratch
from syncsgd.kernels.threads import budget
from syncsgd.layers.base import Layer
from syncsgd.layers.registry import register
from syncsgd.proto import pb

_P = pb.PoolingParameter
_LOWEST = np.float32(-np.finfo(np.float32).max)


def pooled_size(size, kernel, pad, stride, ceil_mode):
    """Caffe's pooled output size along one axis: rounded up or down, and with padding the last
    window must start inside the image."""
    span = size + 2 * pad - kernel
    pooled = (-(-span // stride) if ceil_mode else span // stride) + 1
    if pad and (pooled - 1) * stride >= size + pad:
        pooled -= 1
    return pooled


def _pair(p, field, prefix):
    """(h, w) from a single-valued field or its prefix_h / prefix_w forms, which come together."""
    h, w = f"{prefix}_h", f"{prefix}_w"
    if p.HasField(h) or p.HasField(w):
        if p.HasField(field) or not (p.HasField(h) and p.HasField(w)):
            raise ValueError(f"give either {field} or both {h} and {w}")
        return getattr(p, h), getattr(p, w)
    return getattr(p, field), getattr(p, field)


class _Axis:
    """The phase planes along one axis. Window offset t lies in phase t % stride, t // stride
    positions on; plane position q of phase r holds image index q * stride + r - pad. Phases no
    offset reads (stride > kernel) are left out."""

    def __init__(self, size, kernel, pad, stride, pooled, length=None):
        self.kernel, self.stride = kernel, stride
        self.phases = min(stride, kernel)
        # Plane extent: every position a window reads, unless given.
        self.length = pooled + (kernel - 1) // stride if length is None else length
        # Per phase: (first, stop) plane positions holding the image, and the image index of first.
        self.spans = [inside(r, pad, stride, size, self.length) for r in range(self.phases)]
        self.covers = sum(stop - first for first, stop, _ in self.spans) == size
        self.offsets = [(t % stride, t // stride) for t in range(kernel)]
        # The planes are exactly the image's phases: no padding, nothing left out at the end.
        self.whole = not pad and size == stride * self.length

    def image_slice(self, span):
        """The image indices that plane positions span[0]:span[1] hold."""
        first, stop, start = span
        if stop == first:
            return slice(0, 0)
        return slice(start, start + self.stride * (stop - first - 1) + 1, self.stride)


def _bytes(name, shape):
    """A shared uint8 scratch buffer (im2col.scratch holds float32)."""
    count = math.prod(shape)
    return scratch(name, (-(-count // 4),)).view(np.uint8)[:count].reshape(shape)


def _rows_of(array):
    """The rows (last axis) of `array` as single elements: numpy copies those whole, in one loop,
    where it takes a loop per row of numbers (docs/performance.md, "Pooling: layout")."""
    return array.view(np.dtype((np.void, array.shape[-1] * array.itemsize)))[..., 0]


def _typed(name, shape, dtype):
    """A shared scratch buffer of another type."""
    size = np.dtype(dtype).itemsize * math.prod(shape)
    return _bytes(name, (size,)).view(dtype).reshape(shape)


def _first_max(candidates, out, code, before=None, carry=None):
    """out = the maximum of the candidates (arrays of one shape), code = the index of the first
    candidate holding it; NaN goes to out (see the module docstring). before(t), if given, runs
    before candidate t >= 1 is read. carry = (values, chosen): chosen = values[code] (arrays of
    the codes' type). Returns out, or the candidate when there is only one."""
    if carry:
        values, chosen = carry
        np.copyto(chosen, values[0])
    if len(candidates) == 1:
        return candidates[0]
    small = code.dtype == np.uint8
    flags = code.view(bool) if small else code
    later = _bytes("pooling_later", out.shape).view(bool)
    step = _typed("pooling_step", out.shape, code.dtype)
    for t, candidate in enumerate(candidates[1:], 1):
        if before:
            before(t)
        if t == 1:
            np.greater(candidate, candidates[0], out=flags)
            np.maximum(candidates[0], candidate, out=out)
            won = code                  # 0 or 1
        else:
            np.greater(candidate, out, out=later)
            np.maximum(out, candidate, out=out)
            # (flags as numbers of the codes' type: numpy's loops for mixed types are slow)
            won = later.view(np.uint8) if small else later.astype(code.dtype)
            # code = t where later: a later maximum always has the larger t
            np.multiply(won, code.dtype.type(t), out=step)
            np.maximum(code, step, out=code)
        if carry:       # chosen = values[t] where this one won
            np.subtract(values[t], chosen, out=step)
            np.multiply(step, won, out=step)
            np.add(chosen, step, out=chosen)
    return out


def _sum(candidates, out, before=None):
    """out = the sum of the candidates, as _first_max."""
    if len(candidates) == 1:
        return candidates[0]
    if before:
        before(1)
    np.add(candidates[0], candidates[1], out=out)
    for t, candidate in enumerate(candidates[2:], 2):
        if before:
            before(t)
        out += candidate
    return out


def _sum_back(grad, offsets, targets, unit, before=None):
    """The reverse of a sum stage: add grad (..., n) into targets[a][..., s * unit:s * unit + n]
    for each offset (phase a, shift s), the rest of the targets being 0. Shifts are taken in
    increasing order, before(s) running before shift s > 0. Returns the targets; one that would
    take grad unshifted and nothing else is grad itself (no copy)."""
    n = grad.shape[-1]
    out = list(targets)
    if before is None:
        for a, target in enumerate(targets):
            if [s for phase, s in offsets if phase == a] == [0] and target.shape[-1] == n:
                out[a] = grad
    for level in sorted({s for _, s in offsets}):
        if level and before:
            before(level)
        for a, s in offsets:
            if s != level or out[a] is grad:
                continue
            target = out[a]
            if level:
                view = target[..., s * unit:s * unit + n]
                np.add(view, grad, out=view)
                continue
            np.copyto(target[..., :n], grad)
            if target.shape[-1] > n:
                target[..., n:] = 0
    return out


class _NumpyKernel:
    """The layer's own kernels (below), in the interface of _OneDNNKernel."""

    def __init__(self, layer):
        self.forward, self.backward = layer._numpy_forward, layer._numpy_backward


class _OneDNNKernel:
    """oneDNN's pooling; with `fallback` (MAX), a forward pass whose output holds NaN or a value
    Caffe never selects (-FLT_MAX or less) is redone by `numpy`, and backward follows the pass
    that ran (oneDNN's from its argmax workspace). Its primitives run in the channel-blocked
    layout, or in that of the bottom's form where they have a JIT kernel for it (a
    convolution's NHWC maps read as they are, not reordered there and back): build(tag)
    makes them."""

    def __init__(self, build, numpy, fallback):
        self.build, self.numpy, self.fallback = build, numpy, fallback
        self.primitives = self.ran = build(None)
        self.by_tag = {self.primitives.tag: self.primitives}
        self.ran_numpy = False

    def _primitives_for(self, form):
        if form is None or form.tag is None:
            return self.primitives
        if form.tag not in self.by_tag:
            try:
                primitives = self.build(form.tag)
            except onednn.Unavailable:
                primitives = self.primitives
            self.by_tag[form.tag] = (primitives if primitives.kernel.startswith("jit")
                                     else self.primitives)
        return self.by_tag[form.tag]

    def forward(self, bottom, top):
        self.ran = self._primitives_for(bottom[0].form(0))
        self.ran.forward(Side(bottom[0], 0), Side(top[0], 0))
        if self.fallback:
            form = top[0].form(0)     # its padding channels hold zeros
            out = top[0].data if form is None else form.values
            self.ran_numpy = not out.min() > _LOWEST
        if self.ran_numpy:
            top[0].overwrite(0)            # numpy's pass writes all of it
            self.numpy.forward(bottom, top)

    def backward(self, top, bottom):
        if self.ran_numpy:
            self.numpy.backward(top, bottom)
        else:
            self.ran.backward(Side(top[0], 1), Side(bottom[0], 1))


@register
class PoolingLayer(Layer):
    sample_wise = True
    type = "Pooling"
    takes_forms = True       # its oneDNN kernel reads and writes blobs' forms (blob.py)
    exact_bottoms = 1
    min_tops = 1
    max_tops = 2      # MAX may output its argmax mask (index h * W + w in the plane) as top[1]
    thresholds = THRESHOLDS     # may be replaced per layer (tests force parts of one plane)

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        p = self.param.pooling_param
        self.method = p.pool
        if self.method not in (_P.MAX, _P.AVE):
            self.fail("pooling_param.pool STOCHASTIC is not supported; use MAX or AVE")
        if len(top) > 1 and self.method != _P.MAX:
            self.fail("only MAX pooling has a second top (the argmax mask); remove it")
        self.global_pooling = p.global_pooling
        self.ceil_mode = p.round_mode == _P.CEIL
        try:
            if self.global_pooling:
                if any(p.HasField(f) for f in ("kernel_size", "kernel_h", "kernel_w")):
                    raise ValueError("with global_pooling the kernel is the whole image; remove "
                                     "kernel_size / kernel_h / kernel_w")
                self.kernel = None
            else:
                if not (p.HasField("kernel_size") or p.HasField("kernel_h")
                        or p.HasField("kernel_w")):
                    raise ValueError("kernel_size (or kernel_h and kernel_w) is required")
                self.kernel = _pair(p, "kernel_size", "kernel")
                if min(self.kernel) <= 0:
                    raise ValueError(f"kernel size must be positive, got {self.kernel}")
            self.pad = _pair(p, "pad", "pad")
            self.stride = _pair(p, "stride", "stride")
        except ValueError as e:
            self.fail(f"pooling_param: {e}")
        if min(self.stride) <= 0:
            self.fail(f"pooling_param stride must be positive, got {self.stride}")
        if self.global_pooling and (any(self.pad) or self.stride != (1, 1)):
            self.fail("with pooling_param.global_pooling only pad 0 and stride 1 are allowed")
        if self.kernel and (self.pad[0] >= self.kernel[0] or self.pad[1] >= self.kernel[1]):
            self.fail(f"pooling_param pad {self.pad} must be smaller than the kernel "
                      f"{self.kernel}")
        self._key = self._plan_key = self.plan = None
        self._numpy = self._forward_kernel = _NumpyKernel(self)

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        if len(shape) != 4:
            self.fail(f"bottom must have 4 axes (num, channels, height, width), got {shape}")
        size = shape[2:]
        kernel = size if self.global_pooling else self.kernel
        pooled = tuple(pooled_size(*a, self.ceil_mode)
                       for a in zip(size, kernel, self.pad, self.stride))
        if min(pooled) <= 0:
            self.fail(f"pooled size {pooled} from input {size} is empty: the kernel {kernel} "
                      f"does not fit the padded image")
        for t in top:
            t.reshape(shape[:2] + pooled)
        plan_key = (shape, len(top), budget())
        if plan_key != self._plan_key:
            self._plan_key = plan_key
            self._use_plan(PoolingGeometry(shape, shape[:2] + pooled, kernel, self.pad,
                                           self.stride, self.method == _P.AVE, len(top)),
                           plan_key[2])
        key = (shape, kernel, pooled)
        if key != self._key:
            self._key = key
            self._allocate(shape, kernel, pooled)

    def leaves_forms(self, bottom):
        return self.plan.forward == "onednn"

    def _use_plan(self, geometry, threads):
        """Plan the layer and build its kernel (plans.choose: planned again without oneDNN
        where it lacks the shape). Primitives are built for one shape and team size."""
        def build(plan):
            if plan.forward != "onednn":
                return self._numpy
            return _OneDNNKernel(
                lambda tag: onednn.Pooling(geometry.images, geometry.maps, geometry.kernel,
                                           geometry.pad, geometry.stride, geometry.average,
                                           tag),
                self._numpy, plan.fallback)
        engine = pb.PoolingParameter.Engine.Name(self.param.pooling_param.engine)
        self.plan, self.pool_kernel = choose(plan_pooling, build, geometry, threads, engine,
                                             thresholds=self.thresholds)

    def _allocate(self, shape, kernel, pooled):
        self._pooled = pooled
        n, c, h, w = shape
        (ph, pw), (sh, sw) = self.pad, self.stride
        self._live = None
        self._rows = _Axis(h, kernel[0], ph, sh, pooled[0])
        # Rows one apart and no padding: the first stage's results are the only row plane.
        self._rows_direct = sh == 1 and not ph
        # Columns: the image's own phases when they hold every window (one strided copy each),
        # else planes padded around the image.
        whole = not pw and w % sw == 0 and pooled[1] <= w // sw
        self._cols = _Axis(w, kernel[1], pw, sw, pooled[1], w // sw if whole else None)
        width = self._cols.length
        self._slack = (kernel[1] - 1) // sw              # how far the last shift reads past them
        # A window past the right edge reads the next row's first columns: set to the neutral
        # value before that shift is read (they were read for the last time just before).
        self._wraps = pooled[1] - 1 + self._slack >= width
        # The second stage's grid per image plane: (depth, width), the row planes' shape;
        # rows past PH and columns past PW are junk.
        self._grid = (h if self._rows_direct else self._rows.length, width)
        self._row_slack = (kernel[0] - 1) // sh * width  # how far the last row shift reads
        grid = math.prod(self._grid)
        if self.method == _P.MAX:
            if self.plan.whole_image:
                self._argmax = np.zeros(n * c, np.int64)
                return

            # The codes: kernel row and column offsets (one type for both).
            self._code_type = np.uint8 if max(kernel) < 256 else np.uint16
            # Each window's argmax, as the flat offset i * w + j from the window's start.
            offset_type = np.int16 if (kernel[0] - 1) * w + kernel[1] < 1 << 15 else np.int64
            self._offsets = np.zeros(n * c * grid, offset_type)
            # Where the windows of a part start in the part's images, as flat indices.
            planes = np.arange(min(n * c, self.plan.part))[:, None, None]
            y = (np.arange(pooled[0]) * sh - ph)[:, None]
            start = (planes * h + y) * w + np.arange(width) * sw - pw
            self._starts = start.reshape(len(planes), pooled[0] * width)
        else:
            # Caffe's divisor: the window clipped to the padded image, not to the image.
            sizes = []
            for p, s, k, length, pad in zip(pooled, self.stride, kernel, shape[2:], self.pad):
                start = np.arange(p) * s - pad
                sizes.append(np.minimum(start + k, length + pad) - start)
            size = np.maximum(np.outer(*sizes), 1).astype(np.float32)
            self._pool_size = size
            self._uniform = (size == size.flat[0]).all()
            # On the grid (junk divided by 1).
            grid_size = np.ones(self._grid, np.float32)
            grid_size[:pooled[0], :pooled[1]] = size
            self._grid_size = grid_size.reshape(-1)

    def _parts(self, count):
        """The image planes 0..count in slices of about equal size, at most the plan's part
        each."""
        parts = -(-count // self.plan.part)
        return [slice(i * count // parts, (i + 1) * count // parts) for i in range(parts)]

    def _each_part(self, work, *arrays):
        """work(part, *those arrays' parts) for the parts of the batch, on the plan's threads;
        the arrays are (n, c, ...) blobs, taken as (n*c, ...) image planes."""
        planes = [a.reshape((-1,) + a.shape[2:]) for a in arrays]
        if planes[0].shape[0]:
            spread(self._parts(planes[0].shape[0]),
                   lambda part, worker: work(part, *(a[part] for a in planes)), self.plan.threads)

    def _fill(self):
        return _LOWEST if self.method == _P.MAX else np.float32(0)

    # -- the two stages -------------------------------------------------------------------------
    def _split(self, image):
        """The column planes of `image` (m, h, w): (phases, m*h*width + slack) in the shared
        buffer, the neutral value around the image."""
        cols, fill = self._cols, self._fill()
        m, h, w = image.shape
        count = m * h * cols.length
        planes = scratch("pooling", (cols.phases, count + self._slack))
        flat = image.reshape(-1)
        for b, span in enumerate(cols.spans):
            planes[b, count:] = fill
            if cols.whole:
                np.copyto(planes[b, :count], flat[b::cols.stride])
                continue
            lines = planes[b, :count].reshape(-1, cols.length)
            # Border columns one at a time: one strided run each, not one run per row.
            for column in (*range(span[0]), *range(span[1], cols.length)):
                lines[:, column] = fill
            lines[:, span[0]:span[1]] = image.reshape(-1, w)[:, cols.image_slice(span)]
        return planes

    def _first_stage(self, planes, out, code):
        """Along the window rows: out (m*h*width) from the column planes."""
        cols, fill = self._cols, self._fill()
        count = out.size
        candidates = [planes[b, s:s + count] for b, s in cols.offsets]

        def clear(t):       # the columns a wrapping shift reads: neutral
            b, s = cols.offsets[t]
            if s:
                planes[b, :count].reshape(-1, cols.length)[:, s - 1] = fill
        before = clear if self._wraps else None
        if self.method == _P.MAX:
            return _first_max(candidates, out, code, before)
        return _sum(candidates, out, before)

    def _split_rows(self, rows, planes, fill):
        """rows (m, h, width) into row planes [(m, depth, width)], `fill` around."""
        for plane, span in zip(planes, self._rows.spans):
            plane[:, :span[0]] = fill
            plane[:, span[1]:] = fill
            np.copyto(_rows_of(plane[:, span[0]:span[1]]),
                      _rows_of(rows[:, self._rows.image_slice(span)]))

    def _candidates(self, planes, count):
        """Per kernel row, the run of its rows in the row planes (flat, with the row slack):
        count values from its shift on."""
        width = self._grid[1]
        return [planes[a][s * width:s * width + count] for a, s in self._rows.offsets]

    def _stages(self, image, out, offsets):
        """Both stages: out (m*depth*width) from the images (m, h, w), and for MAX the offsets
        of the argmax (m*depth*width); returns out, or the first stage's values when the kernel
        is one row high."""
        m, h, w = image.shape
        rows, (depth, width) = self._rows, self._grid
        planes = self._split(image)
        count, grid, slack = m * h * width, m * depth * width, self._row_slack
        fill, max_pool = self._fill(), self.method == _P.MAX
        code = codes = None
        if self._rows_direct:
            values = scratch("pooling_values", (count + slack,))
            values[count:] = fill
            if max_pool:        # (the slack is read for junk rows only)
                code = _typed("pooling_codes", (count + slack,), self._code_type)
            result = self._first_stage(planes, values[:count],
                                       None if code is None else code[:count])
            if self._cols.kernel == 1:      # (the column plane itself)
                np.copyto(values[:count], result)
            planes, codes = [values], [code]
        else:
            values = scratch("pooling_values", (count,))
            if max_pool:
                code = _typed("pooling_codes", (count,), self._code_type)
            values = self._first_stage(planes, values, code)
            planes = scratch("pooling_planes", (rows.phases, grid + slack))
            planes[:, grid:] = fill
            self._split_rows(values.reshape(m, h, width),
                             [p[:grid].reshape(m, depth, width) for p in planes], fill)
            if max_pool and self._cols.kernel > 1:
                codes = _typed("pooling_code_planes", (rows.phases, grid + slack),
                               self._code_type)
                self._split_rows(code.reshape(m, h, width),
                                 [k[:grid].reshape(m, depth, width) for k in codes], 0)
        candidates = self._candidates(planes, grid)
        if not max_pool:
            return _sum(candidates, out)
        row = _typed("pooling_row", (grid,), self._code_type)
        column = _typed("pooling_column", (grid,), self._code_type)
        if self._cols.kernel == 1:
            column[...] = 0
            carry = None
        else:
            carry = (self._candidates(codes, grid), column)
        if self._rows.kernel == 1:
            row[...] = 0
        result = _first_max(candidates, out, row, carry=carry)
        np.multiply(row, offsets.dtype.type(w), out=offsets)
        np.add(offsets, column, out=offsets)
        return result

    # -- forward --------------------------------------------------------------------------------
    def forward(self, bottom, top):
        self._forward_kernel = self.pool_kernel      # backward follows it, even across a reshape
        self.pool_kernel.forward(bottom, top)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            self._forward_kernel.backward(top, bottom)

    def _numpy_forward(self, bottom, top):
        """The batch split into parts that the plan's threads take in turn."""
        dead = []       # parts with windows holding no value above -FLT_MAX
        work = self._forward_global if self.plan.whole_image else self._forward_part
        self._each_part(lambda part, image, out: work(part, image, out, dead),
                        bottom[0].data, top[0].data)
        self._live = top[0].data > _LOWEST if dead else None
        if len(top) > 1:
            top[1].data[...] = self._mask()

    def _forward_part(self, part, image, out, dead):
        """image (m, h, w) -> out (m, PH, PW)."""
        m = image.shape[0]
        (ph, pw), (depth, width) = self._pooled, self._grid
        # Written in place when the grid is the top's shape (no junk).
        direct = (depth, width) == (ph, pw)
        grid = out.reshape(-1) if direct else scratch("pooling_wide", (m * depth * width,))
        offsets = None
        if self.method == _P.MAX:
            count = depth * width
            offsets = self._offsets[part.start * count:part.stop * count]
        for attempt in range(2):
            if attempt:     # NaN or values Caffe never selects: drop them and recompute
                image = np.fmax(image, _LOWEST)
            result = self._stages(image, grid, offsets)
            if result is not grid or not direct:
                np.copyto(out, result[:m * depth * width].reshape(m, depth, width)[:, :ph, :pw])
            if self.method == _P.AVE:
                if self._uniform:
                    out /= self._pool_size.flat[0]
                else:
                    np.divide(out, self._pool_size, out=out)
                return
            if out.min() > _LOWEST:
                return
            if attempt:
                dead.append(part)

    def _forward_global(self, part, image, out, dead):
        lines, values = image.reshape(image.shape[0], -1), out.reshape(-1)
        if self.method == _P.AVE:
            np.sum(lines, axis=1, out=values)
            values /= self._pool_size.flat[0]
            return
        np.max(lines, axis=1, out=values)
        if not values.min() > _LOWEST:   # NaN or values Caffe never selects: drop them
            lines = np.fmax(lines, _LOWEST)
            np.max(lines, axis=1, out=values)
            if not values.min() > _LOWEST:
                dead.append(part)
        np.argmax(lines, axis=1, out=self._argmax[part])   # the first maximum

    def _mask(self):
        """Caffe's top mask: the argmax as an index h * W + w into the image plane, or -1."""
        n, c, h, w = self._key[0]
        (ph, pw), (depth, width) = self._pooled, self._grid
        if self.plan.whole_image:
            index = self._argmax.reshape(n, c, 1, 1).copy()
        else:
            offsets = self._offsets.reshape(n, c, depth, width)[:, :, :ph, :pw]
            index = (np.arange(ph) * self.stride[0] - self.pad[0])[:, None] * w \
                + np.arange(pw) * self.stride[1] - self.pad[1] + offsets.astype(np.int64)
        if self._live is not None:
            index[~self._live] = -1
        return index

    # -- backward -------------------------------------------------------------------------------
    def _numpy_backward(self, top, bottom):
        live = None if self._live is None else self._live.reshape(-1, *self._pooled)
        work = (self._backward_global if self.plan.whole_image else
                self._backward_max if self.method == _P.MAX else self._backward_ave)
        self._each_part(lambda part, dy, dx: work(part, dy, dx, live),
                        top[0].diff, bottom[0].diff)

    def _backward_global(self, part, dy, dx, live):
        lines, grad = dx.reshape(dx.shape[0], -1), dy.reshape(-1)
        if self.method == _P.AVE:
            lines[...] = (grad / self._pool_size.flat[0])[:, None]
            return
        if live is not None:
            grad = grad * live[part].reshape(-1)
        lines.fill(0)
        lines[np.arange(lines.shape[0]), self._argmax[part]] = grad

    def _backward_max(self, part, dy, dx, live):
        """Each gradient to its window's argmax: one scatter-add by flat index."""
        m, h, w = dx.shape
        (ph, pw), (depth, width) = self._pooled, self._grid
        grad = dy
        if live is not None:
            grad = scratch("pooling_grad", dy.shape)
            np.multiply(dy, live[part], out=grad)
        count = depth * width
        offsets = self._offsets[part.start * count:part.stop * count]
        index = _typed("pooling_index", (m, ph * width), np.int64)
        np.add(self._starts[:m], offsets.reshape(m, count)[:, :ph * width], out=index)
        index = index.reshape(m, ph, width)[..., :pw]
        if live is not None:
            np.clip(index, 0, dx.size - 1, out=index)   # windows with no winner: gradient 0
        dx.fill(0)
        # (Flat arguments: numpy's fast path; add.at is much slower with more axes.)
        np.add.at(dx.reshape(-1), index.reshape(-1), grad.reshape(-1))

    def _backward_ave(self, part, dy, dx, live):
        """The two stages in reverse, then the planes back into the image."""
        m, h, w = dx.shape
        rows, cols = self._rows, self._cols
        (ph, pw), (depth, width) = self._pooled, self._grid
        grid = scratch("pooling_wide", (m, depth, width))
        grid[:, ph:] = 0
        grid[:, :ph, pw:] = 0
        np.copyto(grid[:, :ph, :pw], dy)
        grid = grid.reshape(m, -1)
        np.divide(grid, self._grid_size, out=grid)
        # Second stage, to the first stage's values (m, h, width).
        count = m * depth * width
        planes = scratch("pooling_planes", (rows.phases, count + self._row_slack))
        planes = _sum_back(grid.reshape(-1), rows.offsets, list(planes), width)
        if self._rows_direct:
            values = planes[0][:m * h * width]
        else:
            values = scratch("pooling_values", (m, h, width))
            if not rows.covers:
                values.fill(0)      # rows no window reads
            for plane, span in zip(planes, rows.spans):
                plane = plane[:count].reshape(m, depth, width)
                np.copyto(_rows_of(values[:, rows.image_slice(span)]),
                          _rows_of(plane[:, span[0]:span[1]]))
            values = values.reshape(-1)

        # First stage, to the column planes.
        def clear(s):       # no gradient to the columns a wrapping shift read
            values.reshape(-1, width)[:, width - s] = 0
        count = values.size
        planes = scratch("pooling", (cols.phases, count + self._slack))
        planes = _sum_back(values, cols.offsets, list(planes), 1, clear if self._wraps else None)
        # Into the image.
        flat = dx.reshape(-1)
        if cols.whole:
            for b in range(cols.stride):
                flat[b::cols.stride] = planes[b][:count] if b < cols.phases else 0
            return
        if not cols.covers:
            dx.fill(0)      # columns no window reads
        lines = dx.reshape(-1, w)
        for b, span in enumerate(cols.spans):
            lines[:, cols.image_slice(span)] = \
                planes[b][:count].reshape(-1, width)[:, span[0]:span[1]]
