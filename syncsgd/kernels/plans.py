"""Which kernels run: one pure function per kind of work, and the one table of thresholds.

plan_convolution, plan_pooling, plan_gemm (every matrix product: InnerProduct, the recurrent
layers, the GEMM convolutions) and plan_update (the solver's update) take the work's geometry,
the thread budget, the layer's `engine` setting and what the machine has (oneDNN loaded, numpy's
BLAS found), and return a small immutable plan; the caller asks for a new plan when its geometry
or the budget changes, and runs what the plan names. `choose` builds a plan's kernels and plans
again without oneDNN where oneDNN lacks the shape. Nothing else picks a kernel, so a speed change
is one edit here, measured as docs/performance.md describes.
"""
import math
from dataclasses import dataclass

from syncsgd import log
from syncsgd.kernels import onednn
from syncsgd.kernels import winograd
from syncsgd.kernels.im2col import Im2Col, RowLowering, WideIm2Col


@dataclass(frozen=True)
class Thresholds:
    """Each value was set by the measurement docs/performance.md names after it (2 cores)."""
    # Columns are made in chunks of samples whose columns fit in this many bytes, so that the
    # GEMM reads them from cache ("Convolution: chunks").
    column_budget_bytes: int = 4 << 20
    # Feature maps of at least this many pixels run one GEMM per sample, not one per chunk
    # ("Convolution: per-sample GEMMs").
    per_sample_pixels: int = 3000
    # Batched stride-1 layers build columns over whole padded rows (WideIm2Col) while its GEMM
    # is at most this much larger ("Convolution: wide columns").
    wide_limit: float = 1.6
    # Batched stride-1 single-group convolutions lower rows (MEC) from this many channels on
    # both sides, up to lowering_max_outputs outputs ("Convolution: row lowering").
    lowering_min_channels: int = 16
    lowering_max_outputs: int = 128
    # The image gradient as a convolution with flipped weights while its GEMM is at most this
    # much larger than the forward one ("Convolution: flipped image gradient").
    flipped_limit: float = 1.3
    # Lowered chunks have row GEMMs of at least this many columns ("Convolution: lowered
    # chunks").
    lowered_min_columns: int = 400
    # Pooling processes the batch in parts of at most this many image values ("Pooling:
    # parts").
    pooling_part_values: int = 1 << 19
    # LRN runs the batch in parts of whole samples of at most this many values (at least one
    # sample), each part through every step while in the cache ("LRN: parts").
    lrn_part_values: int = 1 << 18
    # oneDNN's convolutions take channels-last images and maps where both sides have at least
    # this many channels and one is not a multiple of it ("Convolution: channels last").
    nhwc_min_channels: int = 16
    # Products (2 * m * k * n) of at least this many flops run on oneDNN's matmul ("GEMM:
    # oneDNN's matmul").
    onednn_flops: float = 1.2e7
    # ... and a weight gradient over a cleared diff (transposed A, beta 0) with an output of at
    # least this many values on oneDNN's own GEMM kernel ("GEMM: the weight gradient's kernel").
    gemm_kernel_output: int = 3 << 20
    # BLAS products of at least this many flops are split over the threads, in this many pieces
    # a thread ("GEMM on a shared machine").
    split_flops: float = 2e7
    pieces_per_thread: int = 2
    # BLAS products of fewer flops keep the interpreter lock ("Lanes: a pass in one hand-off").
    held_flops: float = 2e5
    # The update walks a parameter in blocks of this many values: 256 KiB a float32 array, so
    # the 5-7 arrays a rule touches fit a core's L2 cache, while a block is long enough for
    # numpy's per-call overhead not to count. Slices of update_spread_min values and more are
    # shared out to the threads, in blocks twice as long: the threads take turns on the
    # interpreter lock between numpy calls, and fewer calls then gain more than the cache loses
    # ("Solver update").
    update_block: int = 65536
    update_spread_min: int = 8 * 65536
    # Convolutions of fewer flops a forward pass, and products of fewer flops, run on the fixed
    # rules, not timed: their kernels' times differ by less than a timing's noise
    # ("Convolution: timed choice", "GEMM: timed choice").
    timed_min_flops: float = 1e7
    timed_min_gemm_flops: float = 2e7
    # Winograd's chunks hold at least this many tiles per channel (of the larger side of a
    # group): its products then read U once for at least as many bytes of tiles and products
    # as U has, and smaller chunks keep those in the cache between the transforms and the
    # products ("Convolution: Winograd's chunks").
    winograd_tiles_per_channel: float = 0.5
    # ... and products of at least this many multiply-adds a tile point (tiles x channels x
    # outputs of a group): fewer channels make GEMMs too small to run at speed (LeNet's conv2,
    # 20 -> 50) ("Convolution: Winograd F(2x2, 5x5) and strided windows").
    winograd_min_products: int = 1 << 17
    # Where a thread's share of the batch holds fewer tiles, Winograd runs the batch as one
    # chunk and shares out each phase: each thread reading all of U for a few rows of products,
    # and the threads' weight gradients summed, cost more ("Convolution: Winograd's small
    # tiles").
    winograd_shared_tiles: int = 256


THRESHOLDS = Thresholds()


# -- Convolution ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ConvolutionGeometry:
    """One convolution's shape. image_* is the side im2col reads (the bottom of a Convolution, the
    top of a Deconvolution: `reverse`), conv_out the feature channels; sizes and the window have
    one value per spatial axis, (h, w) in 2-D. num counts the samples: the product of the axes
    before the blobs' channel axis, channel_axis (convolution_param.axis). force_nd is
    convolution_param.force_nd_im2col."""
    num: int
    image_channels: int
    conv_out: int
    image_size: tuple
    features_size: tuple
    kernel: tuple
    pad: tuple
    stride: tuple
    dilation: tuple
    group: int
    reverse: bool = False
    channel_axis: int = 1
    force_nd: bool = False


@dataclass(frozen=True)
class ConvolutionPlan:
    """forward and weight_grad: "onednn", "lowered" (RowLowering), "columns" (im2col + GEMM),
    "winograd" (F(2x2, 3x3)), "winograd4" (F(4x4, 3x3)), "winograd_5x5" (F(2x2, 5x5)) or
    "winograd4_5x5" (F(4x4, 5x5)); image_grad:
    "onednn", "flipped" (a lowered convolution with flipped weights), "unlowered" (the lowering's
    gradient summed back), "columns" (col2im) or a Winograd's name. columns: "wide" or "im2col", the
    column layout of the "columns" kernel; per_sample: one GEMM per sample, else one per chunk. The
    batch runs in chunks of `chunk` samples shared out to `threads` threads, except a forward pass
    that is not shared_forward: its chunks run in turn, each GEMM split over the threads (per-sample
    forward passes, whose columns then stay in the cache). keep_columns: forward's columns (one
    chunk) stay for backward if no layer reused them. channels_last: oneDNN is offered channels-last
    images and maps (it keeps them where its brgemm kernels take them in every direction).
    onednn_kernels: a timed choice's (layout, kernel) per direction in onednn.DIRECTIONS order, for
    oneDNN's primitives (None: the fixed rules')."""
    forward: str
    weight_grad: str
    image_grad: str
    columns: str
    per_sample: bool
    chunk: int
    threads: int
    shared_forward: bool
    keep_columns: bool
    channels_last: bool = False
    onednn_kernels: tuple = None


def column_layout(geometry, columns):
    """The WideIm2Col ("wide") or Im2Col ("im2col") of `geometry`."""
    g = geometry
    if columns == "wide":
        return WideIm2Col(g.image_channels, g.image_size, g.kernel, g.pad, g.dilation)
    return Im2Col(g.image_channels, g.image_size, g.kernel, g.pad, g.stride, g.dilation)


def row_lowering(geometry):
    """The forward's RowLowering (of the images)."""
    g = geometry
    return RowLowering(g.image_channels, g.image_size, g.kernel, g.pad)


def flipped_lowering(geometry):
    """The image gradient's RowLowering: of the feature-map gradient, padded by kernel - 1 - pad."""
    g = geometry
    return RowLowering(g.conv_out, g.features_size, g.kernel,
                       tuple(k - 1 - p for p, k in zip(g.pad, g.kernel)))


def plan_convolution(geometry, threads, engine, onednn_available, thresholds=THRESHOLDS):
    """The ConvolutionPlan of `geometry` on `threads` threads. engine is the layer's
    convolution_param.engine by name: CAFFE keeps to the GEMM kernels; otherwise oneDNN runs
    where it loaded (onednn_available), for Convolution only, forward and backward.

    WideIm2Col, the row lowering and oneDNN are 2-D kernels: other numbers of spatial axes, and
    2-D layers with force_nd_im2col (BVLC's im2col_nd), run on Im2Col's columns."""
    g, t = geometry, thresholds
    pixels = math.prod(g.features_size)
    per_sample = pixels >= t.per_sample_pixels
    planar = len(g.kernel) == 2 and not g.force_nd
    stride_1 = planar and g.stride == (1, 1)

    def lowers(channels, outputs):
        """Whether a batched convolution from `channels` to `outputs` channels (the forward
        one, or the image gradient's) runs on RowLowering."""
        return (not g.reverse and not per_sample and stride_1 and g.dilation == (1, 1)
                and g.group == 1 and t.lowering_min_channels <= min(channels, outputs)
                and outputs <= t.lowering_max_outputs)

    # Columns over whole padded rows where the extra columns cost little.
    wide = (stride_1 and not per_sample and column_layout(g, "wide").width
            <= t.wide_limit * g.features_size[1])
    columns = "wide" if wide else "im2col"
    lowered = lowers(g.image_channels, g.conv_out)
    flipped = (lowers(g.conv_out, g.image_channels)
               and all(p < k for p, k in zip(g.pad, g.kernel))
               and math.prod(g.image_size) <= t.flipped_limit * pixels)
    if lowered:
        sample_bytes = [row_lowering(g).sample_bytes]
    else:
        layout = column_layout(g, columns)
        sample_bytes = [4 * layout.rows * layout.pixels]
    if flipped:
        sample_bytes.append(flipped_lowering(g).sample_bytes)
    num = g.num
    chunk = max(1, min(num, t.column_budget_bytes // max(sample_bytes)))
    if not per_sample and threads > 1:
        # Work for every thread, twice.
        chunk = max(1, min(chunk, -(-num // (2 * threads))))
    if lowered:
        # ... but row GEMMs of at least lowered_min_columns columns.
        chunk = min(num, max(chunk, -(-t.lowered_min_columns // g.features_size[1])))
    if threads > 1 and num:
        chunk = _equal_chunks(num, chunk, threads)

    # oneDNN is as fast as the GEMM kernels or faster on every shape measured, and holds the
    # interpreter lock for one call instead of a GEMM per chunk ("Convolution: oneDNN against
    # GEMMs"). It reads the blobs themselves, which must then be (N, C, H, W).
    onednn = (planar and g.channel_axis == 1 and not g.reverse and engine != "CAFFE"
              and onednn_available)
    gemm = "lowered" if lowered else "columns"
    forward = "onednn" if onednn else gemm
    # Channels the blocked layouts would pad.
    few = t.nhwc_min_channels
    channels_last = (onednn and g.group == 1 and min(g.image_channels, g.conv_out) >= few
                     and bool(g.image_channels % few or g.conv_out % few))
    return ConvolutionPlan(
        forward=forward,
        weight_grad=forward,
        image_grad=("onednn" if onednn else "flipped" if flipped
                    else "unlowered" if lowered else "columns"),
        columns=columns,
        per_sample=per_sample, chunk=chunk, threads=threads, shared_forward=not per_sample,
        keep_columns=forward == "columns" and 0 < num <= chunk, channels_last=channels_last)


GEMM = ("gemm",)     # a timed choice's candidate: the fixed rules' GEMM kernel of a direction


def convolution_candidates(geometry, threads, engine, onednn_kernels, thresholds=THRESHOLDS):
    """What a timed choice may run each direction of `geometry` on ({direction: [candidate,
    ...]}, directions as in onednn.DIRECTIONS), or None where there is no choice to make (the
    fixed rules then run it): GEMM (the fixed rules' GEMM kernel) and, where the fixed rules
    would run oneDNN, each ["onednn", layout, kernel] of onednn_kernels() ({direction:
    [(layout, kernel name), ...]}: onednn.ConvolutionKernels, None where oneDNN lacks the
    shape), asked only then; and [name] for each Winograd kernel that computes the geometry
    here (winograd.names)."""
    g = geometry
    flops = 2.0 * g.num * math.prod(g.features_size) * g.conv_out * math.prod(g.kernel) * (
        g.image_channels // g.group)
    if (flops < thresholds.timed_min_flops
            or plan_convolution(g, threads, engine, True, thresholds).forward != "onednn"):
        return None
    offered = onednn_kernels()
    if offered is None:
        return None

    def worth_timing(kernels):
        """SSE4.1 kernels beside AVX ones are not timed: they took 2.5-3x as long ("Convolution:
        timed choice")."""
        if any("avx" in kernel for _, kernel in kernels):
            return [(layout, kernel) for layout, kernel in kernels if "sse41" not in kernel]
        return kernels
    extra = [[name] for name in winograd.names(g)]
    return {direction: [list(GEMM)] + extra + [
        ["onednn", layout, kernel] for layout, kernel in worth_timing(offered[direction])]
            for direction in offered}


def timed_convolution(geometry, threads, engine, choice, thresholds=THRESHOLDS):
    """The ConvolutionPlan that runs each direction on what `choice` ({direction: candidate}
    from convolution_candidates) names."""
    gemm = plan_convolution(geometry, threads, engine, False, thresholds)
    names = {"forward": gemm.forward, "image_grad": gemm.image_grad,
             "weight_grad": gemm.weight_grad}
    kernels = []
    for direction in names:
        candidate = choice[direction]
        if candidate[0] != "gemm":
            names[direction] = candidate[0]
        kernels.append(tuple(candidate[1:]) if candidate[0] == "onednn" else None)
    # Winograd's own chunks where no GEMM kernel shares them (those were timed on theirs):
    # F(4x4, 3x3)'s where it runs, for F(2x2, 3x3) too, so that a direction timed on one runs
    # on the same chunks beside the other (F(4x4)'s products read 2.25 times the U for its
    # tiles).
    chunked = {name for name in names.values() if name != "onednn"}
    chunk = gemm.chunk
    if chunked and chunked <= set(winograd.VARIANTS):
        chunk = _winograd_chunk(geometry, threads, thresholds, winograd.tile_outputs(geometry))
    return ConvolutionPlan(
        forward=names["forward"], weight_grad=names["weight_grad"],
        image_grad=names["image_grad"], columns=gemm.columns, per_sample=gemm.per_sample,
        chunk=chunk, threads=threads,
        shared_forward=gemm.shared_forward or names["forward"] in winograd.VARIANTS,
        keep_columns=gemm.keep_columns and names["forward"] == "columns"
        and names["weight_grad"] == "columns",
        onednn_kernels=tuple(kernels) if any(kernels) else None)


def gradient_pairs(choice, candidates):
    """What to time the two gradients on together after each direction's own choice (`choice`,
    from convolution_candidates' `candidates`), as whole choices: this one, and both gradients
    on each Winograd kernel offered to both; None where the choice runs both on one of them
    already or none is offered. Timed alone, an image gradient on Winograd's kernel makes its
    own dM = A dY A^T, which it takes from a weight gradient on the same kernel: LeNet's conv2
    (batch 64, 2 threads, AVX2) took oneDNN's weight gradient (1.67 ms against F(2x2, 5x5)'s
    1.70) beside F(2x2, 5x5)'s image gradient, 3.3 ms a backward pass in the net against 2.6
    on F(2x2, 5x5) for both ("Convolution: timed choice")."""
    shared = [c for c in candidates["weight_grad"]
              if c[0] in winograd.VARIANTS and c in candidates["image_grad"]]
    if not shared or (choice["weight_grad"] == choice["image_grad"]
                      and choice["weight_grad"] in shared):
        return None
    return [dict(choice)] + [{**choice, "weight_grad": c, "image_grad": c} for c in shared]


def timing_convolution(geometry, threads, engine, direction, candidate, thresholds=THRESHOLDS):
    """The ConvolutionPlan a timed choice runs `candidate` of `direction` on: the other
    directions (which the timing does not run) on the same candidate where it is Winograd's,
    so that it is timed on the chunks it takes where no GEMM kernel shares them, as in most
    plans it ends up in; the GEMM kernel otherwise. (Timed on the GEMM kernels' chunks, F(2x2,
    3x3) took 50 ms for AlexNet's conv4 at batch 32, 2 threads, and 34 on its own.)"""
    own = candidate if candidate[0] in winograd.VARIANTS else list(GEMM)
    choice = {d: own for d in ("forward", "weight_grad", "image_grad")}
    return timed_convolution(geometry, threads, engine, {**choice, direction: candidate},
                             thresholds)


def _winograd_chunk(geometry, threads, thresholds, size):
    """Chunks of thresholds.winograd_tiles_per_channel tiles of size x size outputs per
    channel or more, and of thresholds.winograd_min_products multiply-adds a tile point or
    more, but one for every thread where the batch has enough samples, as equal as they come;
    the whole batch where a thread's share holds fewer than thresholds.winograd_shared_tiles
    (kernels/winograd.py then shares out each phase)."""
    g = geometry
    tiles = math.prod(-(-extent // size) for extent in g.features_size)
    if threads > 1 and tiles * -(-g.num // threads) < thresholds.winograd_shared_tiles:
        return g.num
    channels, outputs = winograd.channels(g) // g.group, g.conv_out // g.group
    least = max(thresholds.winograd_tiles_per_channel * max(channels, outputs),
                thresholds.winograd_min_products / (channels * outputs))
    chunk = max(1, math.ceil(least / max(tiles, 1)))
    return max(1, _equal_chunks(g.num, max(1, min(chunk, -(-g.num // threads))), threads))


def _equal_chunks(num, chunk, threads):
    """The chunk size that splits `num` samples into equal chunks, no larger than `chunk`, as
    many per thread (threads take fixed groups of chunks)."""
    count = -(-num // chunk)
    return -(-num // (-(-count // threads) * threads))


# -- Pooling --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PoolingGeometry:
    """One pooling: (n, c, h, w) images into (n, c, ph, pw) maps; kernel, pad, stride (h, w)."""
    images: tuple
    maps: tuple
    kernel: tuple
    pad: tuple
    stride: tuple
    average: bool
    tops: int


@dataclass(frozen=True)
class PoolingPlan:
    """forward (and backward): "onednn" or "numpy". fallback: a oneDNN MAX forward whose output
    holds a value Caffe never selects (NaN, -FLT_MAX or less) is redone on numpy, and its
    backward follows. whole_image: one window covers the image (numpy's reductions); part:
    image planes per part of the numpy kernels, parts shared out to `threads` threads."""
    forward: str
    fallback: bool
    whole_image: bool
    part: int
    threads: int


def plan_pooling(geometry, threads, engine, onednn_available, thresholds=THRESHOLDS):
    """The PoolingPlan of `geometry`. oneDNN (engine not CAFFE, where it loaded) runs where it
    computes Caffe's result: one top (no mask), AVE without padding (Caffe's divisor counts the
    padding, not what lies past it), no window starting past the image, a non-empty batch; not
    for whole-image windows."""
    g = geometry
    (h, w), pooled = g.images[2:], g.maps[2:]
    whole_image = (pooled == (1, 1) and g.kernel[0] - g.pad[0] >= h
                   and g.kernel[1] - g.pad[1] >= w)
    past = any((p - 1) * s - pad >= size for p, s, pad, size in
               zip(pooled, g.stride, g.pad, g.images[2:]))
    onednn = (engine != "CAFFE" and onednn_available and g.tops == 1 and not whole_image
              and not past and not (g.average and any(g.pad)) and math.prod(g.images) > 0)
    return PoolingPlan(forward="onednn" if onednn else "numpy",
                       fallback=onednn and not g.average, whole_image=whole_image,
                       part=max(1, thresholds.pooling_part_values // (h * w)), threads=threads)


# -- Matrix products ------------------------------------------------------------------------------
ALIGN = 16          # split pieces start at multiples of this many rows or columns


@dataclass(frozen=True)
class GemmPlan:
    """kernel: "onednn" (its matmul; onednn_kernel: the name prefix of the kernel to ask for, or
    None for its first choice), "blas" (cblas_sgemm; held: keeping the interpreter lock) or
    "numpy" (matmul, on numpy's default threads). split, for "blas": "none", "columns" or "rows"
    (independent pieces of the output) or "sum" (pieces of the inner dimension, each thread
    adding into a matrix of its own), over `threads` threads in pieces_per_thread pieces each."""
    kernel: str
    split: str = "none"
    held: bool = False
    onednn_kernel: str = None
    threads: int = 1


def plan_gemm(m, k, n, alpha, beta, layouts, threads, blas_available, onednn_available,
              thresholds=THRESHOLDS):
    """The GemmPlan of out (m, n) = alpha * a (m, k) @ b (k, n) + beta * out. layouts: each
    operand's "N" (row-major) or "T" (a transposed view) where all three are float32 views BLAS
    can read in place, else None."""
    t = thresholds
    flops = 2.0 * m * n * k
    if layouts is None or not (blas_available or onednn_available):
        return GemmPlan("numpy")
    if (onednn_available and flops >= t.onednn_flops and alpha == 1.0 and beta in (0.0, 1.0)
            and layouts[2] == "N"):      # a column-major output runs oneDNN's reference kernel
        weight_gradient = layouts[0] == "T" and beta == 0.0 and m * n >= t.gemm_kernel_output
        return GemmPlan("onednn", onednn_kernel=onednn.GEMM_KERNEL if weight_gradient else None)
    if not blas_available:
        return GemmPlan("numpy")
    if threads == 1 or flops < t.split_flops:
        return GemmPlan("blas", held=flops < t.held_flops)
    wide = threads * t.pieces_per_thread * 4 * ALIGN
    split = "columns" if n >= wide else "rows" if m >= wide else "sum"
    return GemmPlan("blas", split=split, threads=threads)


def gemm_candidates(m, k, n, alpha, beta, layouts, threads, blas_available, onednn_available,
                    thresholds=THRESHOLDS):
    """The GemmPlans a timed choice may run a product on (as dicts), or None where there is no
    choice to make: products below timed_min_gemm_flops, or ones only numpy can run. oneDNN's
    matmul on its first choice of kernel and on its own GEMM kernel where it can run the product
    (alpha 1, beta 0 or 1, a row-major output), and BLAS on one thread or split every way."""
    if layouts is None or 2.0 * m * n * k < thresholds.timed_min_gemm_flops:
        return None
    candidates = []
    if onednn_available and alpha == 1.0 and beta in (0.0, 1.0) and layouts[2] == "N":
        candidates += [GemmPlan("onednn"), GemmPlan("onednn", onednn_kernel=onednn.GEMM_KERNEL)]
    if blas_available:
        candidates.append(GemmPlan("blas"))
        if threads > 1:
            candidates += [GemmPlan("blas", split=split, threads=threads)
                           for split in ("columns", "rows", "sum")]
    return [plan.__dict__ for plan in candidates] if len(candidates) > 1 else None


def batched_gemm_candidates(count, m, k, n, beta, out_rows, onednn_available,
                            thresholds=THRESHOLDS):
    """The kernels a batch of `count` equal products may run on, the rule's choice first:
    "onednn" (one matmul primitive over the batch: beta 0 or 1 and `out_rows`, an output whose
    rows are contiguous) and "loop" (a gemm each, planned as gemm plans it); one where there is
    no choice to time (below timed_min_gemm_flops). Few calls of oneDNN's batched kernels keep
    short products near the GEMM rate, but not every shape (docs/performance.md, "Convolution:
    Winograd's products in one call")."""
    if not (onednn_available and beta in (0.0, 1.0) and out_rows):
        return ["loop"]
    if 2.0 * count * m * k * n < thresholds.timed_min_gemm_flops:
        return ["onednn"]
    return ["onednn", "loop"]


# -- The solver's update ------------------------------------------------------------------------
@dataclass(frozen=True)
class UpdatePlan:
    """kernel: "level1" (SGD's momentum step in BLAS level-1 calls) or "ufuncs" (any rule, block
    by block); the parameter walked in blocks of `block` values, shared out to the threads or
    not (`shared`)."""
    kernel: str
    block: int
    shared: bool


def plan_update(size, threads, momentum_rule, level1_available, thresholds=THRESHOLDS):
    """The UpdatePlan of a parameter slice of `size` values. momentum_rule: the step is SGD's
    momentum step on a gradient linear in diff and data (no L1 decay), on writable contiguous
    float32 arrays of one size."""
    t = thresholds
    shared = size >= t.update_spread_min and threads > 1
    return UpdatePlan(kernel="level1" if momentum_rule and level1_available else "ufuncs",
                      block=2 * t.update_block if shared else t.update_block, shared=shared)


# -- Building -----------------------------------------------------------------------------------
_NOTED = set()


def choose(plan, build, *args, thresholds=THRESHOLDS):
    """(plan, kernels): plan(*args, onednn_available, thresholds) and build(plan); where oneDNN
    lacks the shape (build raises onednn.Unavailable), the plan made without oneDNN, said once
    per kind of plan in the log. What a layer (or a product) keeps until its geometry changes."""
    chosen = plan(*args, onednn.available(), thresholds=thresholds)
    try:
        return chosen, build(chosen)
    except onednn.Unavailable as e:
        if plan not in _NOTED:
            _NOTED.add(plan)
            log.info(f"{plan.__name__}: oneDNN lacks a shape, which runs without it: {e}")
        chosen = plan(*args, False, thresholds=thresholds)
        return chosen, build(chosen)
