"""The layer protocol every layer type follows, as in Caffe.

setup(bottom, top)     read the LayerParameter, check bottoms, create weight blobs (self.blobs)
reshape(bottom, top)   give tops their shapes from the bottoms' shapes; size internal buffers
forward(bottom, top)   fill top[i].data
backward(top, propagate_down, bottom)
                       from top[i].diff, fill bottom[i].diff where propagate_down[i] is true and
                       accumulate into self.blobs[j].diff where propagates_param(j) (Caffe
                       accumulates parameter gradients, the solver clears them)
"""
from collections import namedtuple

from syncsgd.errors import ShapeError

# Rows [start, stop) along `axis` of a parameter whose full length on that axis is `total`.
Part = namedtuple("Part", "axis start stop total")


class Fusion:
    """Two consecutive layers run as one (Layer.absorb): `forward` and `backward` say whether
    the net runs both in the pass at hand, so that the first may do the second's work (set by
    the net before each pass); `sums` carries what the second's backward hands the first's."""

    def __init__(self):
        self.forward = self.backward = True
        self.sums = None


class Layer:
    type = None               # the Caffe type string, e.g. "Convolution"
    # The Caffe fork a type comes from ("weiliu89/caffe (ssd)"), or "" for BVLC Caffe's own.
    fork = ""
    # True for the types syncsgd inserts itself (the model-parallel partitioner's), which no
    # prototxt names and layer_type_list() leaves out.
    internal = False
    exact_bottoms = None      # number of bottoms the layer takes, or None for "not checked"
    min_bottoms = 0
    max_bottoms = None
    exact_tops = None
    min_tops = 0
    max_tops = None
    is_loss = False           # a loss layer's first top has loss_weight 1 by default
    in_place_ok = False       # True where top may be the same blob as bottom
    # True where each output value comes from the input value at the same place (no parameter
    # indexed by feature), so the layer runs unchanged on a model-parallel slice of the features;
    # the partitioner and the planner then leave its input split instead of regathering it.
    feature_local = False
    # True where each sample's outputs and gradients come from that sample alone (and the
    # parameters): the batch may then be cut into parts that run apart (syncsgd.lanes). Such a
    # layer's reshape (and a batch_sums layer's) must derive only sizes and buffers from its
    # bottoms' shapes: a lane reshapes its layers once, when it is built, not at every pass.
    sample_wise = False
    # True where samples meet only in the sums the layer takes through ctx.allreduce_sum (a
    # loss's sum and normaliser, accuracy's counts) and every top is such a whole-batch value:
    # the batch may be cut into parts too, each part's sums added to the others' (lanes, ranks).
    batch_sums = False
    # True where the layer reads and writes its blobs' oneDNN forms (blob.py): a blob that only
    # such layers touch may stay in one between them; others read the NCHW arrays.
    takes_forms = False
    # True where forward leaves its tops in the layout its bottoms come in (ReLU, Split, Scale,
    # Eltwise, LRN, BatchNorm): they get forms where a bottom does (leaves_forms).
    passes_forms = False
    # Set by the net where no layer runs in place on any of this layer's tops: a layer that
    # copies its bottom into its tops (Split) may then hand them the bottom's values instead.
    tops_read_only = False
    # Set by the net: a later layer runs in place on one of this layer's tops (what its own
    # forward wrote may be gone by its backward).
    tops_rewritten_later = False
    # Set by the net, one per bottom: no layer runs in place on it, so no backward writes its
    # diff after this layer's (a layer whose gradient for it is its top's may hand it that).
    bottoms_kept = ()

    @classmethod
    def forms_for(cls, param, phase):
        """takes_forms of a layer of this type made from `param` in `phase`, known before it
        is set up (Net marks its blobs with it before setting up any layer)."""
        return cls.takes_forms

    def __init__(self, param, ctx):
        self.param = param    # the layer's LayerParameter
        self.ctx = ctx        # syncsgd.context.Context of the net
        self.name = param.name
        self.blobs = []       # learnable (or stored) parameter blobs, in Caffe's order
        # Caffe's param_propagate_down: one flag per blob, set by the net (False for lr_mult 0);
        # None (a layer outside a net) computes every parameter's gradient.
        self.param_propagate_down = None
        # For a model-parallel layer: blob index -> Part, the slice of the full (Caffe-shaped)
        # parameter this rank holds. Weight files always hold full parameters.
        self.blob_parts = {}

    def leaves_forms(self, bottom):
        """Whether forward leaves its tops that take forms in forms (asked by the net once the
        layer is set up, its kernels chosen: Blob.gets_forms)."""
        return self.passes_forms and any(b.gets_forms for b in bottom)

    def absorb(self, follower, bottom, top, follower_bottom, follower_top):
        """A Fusion where this layer can do some of `follower`'s work (the layer right after
        it in the net), else None. Asked once by the net, after setup."""
        return None

    # -- the four verbs -----------------------------------------------------------------------
    def setup(self, bottom, top):
        pass

    def reshape(self, bottom, top):
        raise NotImplementedError

    def forward(self, bottom, top):
        raise NotImplementedError

    def backward(self, top, propagate_down, bottom):
        pass

    def propagates_param(self, k):
        """Whether backward adds a gradient into self.blobs[k].diff: not for a parameter the
        net does not learn (lr_mult 0), as in Caffe, which leaves its diff as the solver's
        clearing left it."""
        flags = self.param_propagate_down
        return flags is None or flags[k]

    def allow_force_backward(self, bottom_index):
        """Whether force_backward may send gradients to this bottom (never to a loss's labels)."""
        return not (self.is_loss and bottom_index == 1)

    # -- helpers ------------------------------------------------------------------------------
    def check_counts(self, bottom, top):
        """Raise a ShapeError naming the layer when it has the wrong number of bottoms or tops."""
        for what, blobs, exact, lo, hi in (
                ("bottom", bottom, self.exact_bottoms, self.min_bottoms, self.max_bottoms),
                ("top", top, self.exact_tops, self.min_tops, self.max_tops)):
            n = len(blobs)
            if exact is not None and n != exact:
                raise ShapeError(f"layer '{self.name}' ({self.type}) takes {exact} {what} "
                                 f"blob(s), got {n}")
            if n < lo or (hi is not None and n > hi):
                bound = f"{lo}..{hi}" if hi is not None else f"at least {lo}"
                raise ShapeError(f"layer '{self.name}' ({self.type}) takes {bound} {what} "
                                 f"blob(s), got {n}")

    def fail(self, message):
        raise ShapeError(f"layer '{self.name}' ({self.type}): {message}")

    def __repr__(self):
        return f"<{self.type} layer '{self.name}'>"


def canonical_axis(axis, num_axes, layer=None):
    """Caffe's CanonicalAxisIndex: negative axes count from the end; out of range is an error."""
    if not -num_axes <= axis < max(num_axes, 1):
        where = f"layer '{layer.name}': " if layer is not None else ""
        raise ShapeError(f"{where}axis {axis} out of range for a {num_axes}-axis blob")
    return axis + num_axes if axis < 0 else axis
