"""oneDNN's convolutions and pooling (Intel's deep learning kernels, the library Intel Caffe and
PyTorch run on CPUs), through its C API, for Convolution and Pooling layers whose engine is
DEFAULT.

Why: a convolution as GEMM over lowered columns (im2col.py) spends much of its time packing the
big lowered operand for BLAS, and GEMMs with few rows (CIFAR-sized layers) run well below the
rate of square ones. oneDNN's JIT kernels convolve blocked layouts (channels in blocks of 8 on
AVX2) directly, with the weights held in registers (docs/performance.md, "Convolution: oneDNN
against GEMMs").

Each call takes its operands in the layouts the primitive chose: from a blob's Form when the
layer before left it in one that fits, else reordered from the NCHW array into buffers shared
by all layers (im2col.scratch); the reorder is skipped when the primitive chose the plain
layout. A result goes into a Form of its blob when every layer touching the blob runs on oneDNN
(Blob.takes_forms), else it is reordered back into the array. So a run of convolutions,
poolings and ReLUs reorders only at its ends, and the NCHW arrays users read are brought up to
date when read (blob.py). SYNCSGD_FORMS=0 reorders every result back. Parameter
gradients are added into the diffs (Caffe's accumulate semantics) by a reorder with a sum
post-op, or written over a cleared diff. Everything runs on the calling thread's OpenMP team,
sized to the process's share of the cores (the thread budget) before primitives are built and
before each call.

The library comes from the `onednn-cpu-gomp` wheel (libdnnl.so.3 under sys.prefix/lib, needs
the system's libgomp.so.1); SYNCSGD_ONEDNN=0 turns it off. Where it cannot be loaded, or does
not implement a layer's shape, available() is False or Convolution / Pooling raise Unavailable,
and the layer's plan falls back to its own kernels. With SYNCSGD_REQUIRE_ONEDNN=1 (CI, wherever
libgomp.so.1 exists) a library that does not load is an error instead, so that tests of the
default engine cannot pass on the fallback.
"""
import ctypes
import functools
import glob
import os
import site
import sys
import threading
import weakref

import numpy as np

from syncsgd import switches
from syncsgd.blob import Side
from syncsgd.errors import SyncSGDError
from syncsgd.kernels.scratch import scratch, scratch_at_least
from syncsgd.kernels.threads import budget, timed_held

_F32, _ANY, _CPU, _IN_ORDER = 3, 1, 1, 1
_PLAIN_TAG = {1: 2, 2: 3, 3: 4, 4: 5, 5: 6}                  # dnnl_a .. dnnl_abcde
_FORWARD_TRAINING, _CONVOLUTION_DIRECT = 64, 1
_BACKWARD, _BACKWARD_DATA = 128, 160
# Normalisation arguments and flags (dnnl_use_global_stats, dnnl_use_scale, dnnl_use_shift).
MEAN, VARIANCE, SCALE, SHIFT, DIFF_SCALE, DIFF_SHIFT = 49, 50, 51, 52, 255, 256
_GLOBAL_STATS, _USE_SCALE, _USE_SHIFT = 0x1, 0x2, 0x4
_SRC_MD, _DIFF_SRC_MD, _WEIGHTS_MD, _DIFF_WEIGHTS_MD, _DST_MD, _DIFF_DST_MD = (
    129, 130, 131, 132, 133, 134)
SRC, DST, WEIGHTS, BIAS, DIFF_SRC, DIFF_DST, DIFF_WEIGHTS, DIFF_BIAS = (
    1, 17, 33, 41, 129, 145, 161, 169)
_POOLING_MAX, _POOLING_AVERAGE = 0x1ff, 0x3ff    # dnnl_pooling_max, _avg_exclude_padding
_LRN_ACROSS, _LRN_WITHIN = 0xaff, 0xbff          # dnnl_lrn_across_channels, _within_channel
_WORKSPACE_MD, WORKSPACE = 135, 64
# dnnl_query_scratchpad_md, DNNL_ARG_SCRATCHPAD, dnnl_scratchpad_mode_user: see _Library.attr.
_SCRATCHPAD_MD, SCRATCHPAD, _USER_SCRATCHPAD = 136, 80, 1
# dnnl_aBcd8b and dnnl_aBcd16b (nChw8c, nChw16c): channels in blocks of 8 or 16, the layouts
# the convolutions choose on AVX2 and AVX-512. Pooling runs in the convolutions' one, where
# oneDNN has JIT kernels (on plain NCHW it has only a reference kernel, slower than numpy's:
# docs/performance.md, "Pooling: oneDNN") and where a convolution's output form is read as it
# is. Any layout gives the same results (operands are reordered to it and back).
_CHANNEL_BLOCKS = (102, 78)
# dnnl_acdb (NHWC), for a convolution's images and maps where its plan says channels_last, and
# dnnl_query_impl_info_str.
_NHWC, _IMPLEMENTATION = 22, 8
_Dims = ctypes.c_int64 * 12
_P = ctypes.c_void_p
# Reorders of fewer values run keeping the interpreter lock: a few microseconds, less than
# another thread's turn with the lock would cost (docs/performance.md, "Lanes: a pass in one
# hand-off").
HELD_VALUES = 1 << 15
# Spins of an idle OpenMP worker before it sleeps: 100-200 us on a Zen 4, where a wake-up costs
# 20-90 us (libgomp spins 3 ms unless told).
SPIN_COUNT = 5000
# The name of oneDNN's own GEMM kernel among a matmul's (gemm:jit:f32), which reads a
# transposed operand in place where its first choice copies it into blocks.
GEMM_KERNEL = "gemm:jit"


class Unavailable(SyncSGDError):
    """oneDNN cannot run this (library missing, or the shape not implemented); raised while a
    layer is built it means GEMMs, while it runs it ends the job with this message."""


class Required(SyncSGDError):
    """SYNCSGD_REQUIRE_ONEDNN=1 and the library does not load."""


class _Arg(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_int), ("memory", _P)]


class _Version(ctypes.Structure):
    """dnnl_version_t."""
    _fields_ = [("major", ctypes.c_int), ("minor", ctypes.c_int), ("patch", ctypes.c_int),
                ("hash", ctypes.c_char_p), ("cpu_runtime", ctypes.c_uint),
                ("gpu_runtime", ctypes.c_uint)]


_SYNCHRONOUS_RUNTIMES = (1, 2, 4)     # DNNL_RUNTIME_SEQ, _OMP, _TBB


class _Library:
    """libdnnl, its CPU engine and stream, and the OpenMP runtime it runs on."""

    def __init__(self):
        if not switches.onednn():
            raise Unavailable("turned off by SYNCSGD_ONEDNN=0")
        # Idle workers spin about as long as waking one costs, then sleep: sleeping at once costs
        # a wake-up at each parallel region (several a primitive), spinning on holds the cores
        # the other layers' threads need (docs/performance.md, "OpenMP's wait policy").
        if "OMP_WAIT_POLICY" not in os.environ:
            os.environ.setdefault("GOMP_SPINCOUNT", str(SPIN_COUNT))
        self.lib = self._load()
        try:
            self.omp = ctypes.CDLL("libgomp.so.1")
        except OSError:
            self.omp = None
        self.threads = threading.local()   # omp_set_num_threads holds for the calling thread
        self._blocks = None                 # channel_blocks(), probed when first asked
        self.building = threading.local()   # each thread's objects made, for _Primitives to own
        self.lib.dnnl_primitive_desc_query_md.restype = _P
        self.lib.dnnl_memory_desc_get_size.restype = ctypes.c_size_t
        # The calls every primitive run makes, typed so that ctypes converts nothing itself.
        # Pointing a memory object at an array is a store: it keeps the interpreter lock (a
        # PyDLL handle), which another lane would otherwise take in between (lanes.py).
        # So is a reorder of fewer than HELD_VALUES values.
        held = ctypes.PyDLL(self.lib._name)
        self.set_handle = held.dnnl_memory_set_data_handle
        self.set_handle.argtypes = [_P, _P]
        self.held_execute = held.dnnl_primitive_execute
        # Comparing two layouts, which a blob's form does as each layer reads it, is as short.
        self.held_equal = held.dnnl_memory_desc_equal
        self.held_equal.argtypes = [_P, _P]
        for fn in (self.lib.dnnl_primitive_execute, self.held_execute):
            fn.argtypes = [_P, _P, ctypes.c_int, _P]
        if switches.checks():
            self.held_execute = timed_held(self.held_execute, "a oneDNN primitive")
        self.lib.dnnl_stream_wait.argtypes = [_P]
        # On the OpenMP, TBB and sequential CPU runtimes a primitive has finished when execute
        # returns; only the others need the stream waited for.
        self.lib.dnnl_version.restype = ctypes.POINTER(_Version)
        self.synchronous = self.lib.dnnl_version().contents.cpu_runtime in _SYNCHRONOUS_RUNTIMES
        self.engine, self.stream = _P(), _P()
        self.check(self.lib.dnnl_engine_create(ctypes.byref(self.engine), _CPU,
                                               ctypes.c_size_t(0)), "creating the CPU engine")
        self.check(self.lib.dnnl_stream_create(ctypes.byref(self.stream), self.engine,
                                               ctypes.c_uint(_IN_ORDER)), "creating a stream")

    @staticmethod
    def _load():
        roots = [sys.prefix, site.getuserbase(), sys.base_prefix]
        candidates = [p for root in roots
                      for p in sorted(glob.glob(os.path.join(root, "lib", "libdnnl.so.3*")))]
        errors = []
        for path in candidates + ["libdnnl.so.3"]:
            try:
                return ctypes.CDLL(path)
            except OSError as e:
                errors.append(str(e))
        raise Unavailable("libdnnl.so.3 not loadable (pip install onednn-cpu-gomp; it needs the "
                          "system's libgomp.so.1): " + "; ".join(errors[-2:]))

    @staticmethod
    def check(status, what):
        if status != 0:
            raise Unavailable(f"oneDNN failed {what} (status {status})")

    @property
    def created(self):
        """(kind, handle) of every object this thread made and no _Primitives owns yet."""
        made = getattr(self.building, "made", None)
        if made is None:
            made = self.building.made = []
        return made

    def own(self, kind, handle):
        """Record `handle`, a new dnnl_<kind>_t, for its owner to destroy."""
        self.created.append((kind, handle))
        return handle

    def destroy(self, handles):
        for kind, handle in reversed(handles):
            getattr(self.lib, f"dnnl_{kind}_destroy")(handle)

    def set_threads(self):
        """Size the OpenMP team to the process's share of the cores (primitives pick their
        blocking for the team they are built for)."""
        share = budget()
        if self.omp is not None and share != getattr(self.threads, "share", None):
            self.omp.omp_set_num_threads(share)
            self.threads.share = share

    def channel_blocks(self):
        """The channel-blocked layout (tag) this machine's convolutions choose for their maps."""
        if self._blocks is None:
            probe = Convolution((1, 32, 8, 8), (1, 32, 8, 8), (3, 3), (1, 1), (1, 1), (1, 1), 1,
                                False)
            chosen = probe.f_maps.chosen
            self._blocks = next((tag for tag in reversed(_CHANNEL_BLOCKS)
                                 if self.same(self.desc((1, 32, 8, 8), tag), chosen)),
                                _CHANNEL_BLOCKS[0])
        return self._blocks

    def tag_of(self, shape, md):
        """The tag of layout `md` of a `shape` tensor among those layers choose (channel
        blocks, NHWC), or None (inside a _build: the descriptors it compares are owned)."""
        return next((tag for tag in (*_CHANNEL_BLOCKS, _NHWC)
                     if self.same(self.desc(shape, tag), md)), None)

    def desc(self, shape, tag=None):
        md = _P()
        self.check(self.lib.dnnl_memory_desc_create_with_tag(
            ctypes.byref(md), len(shape), _Dims(*shape), _F32,
            _PLAIN_TAG[len(shape)] if tag is None else tag), f"describing {shape}")
        return self.own("memory_desc", md)

    def query(self, pd, what):
        return _P(self.lib.dnnl_primitive_desc_query_md(pd, what, 0))

    def implementation(self, pd):
        """The name of the kernel oneDNN chose for a primitive descriptor (jit:..., brg...,
        ref:...)."""
        name = ctypes.c_char_p()
        self.check(self.lib.dnnl_primitive_desc_query(pd, _IMPLEMENTATION, 0,
                                                      ctypes.byref(name)), "naming a kernel")
        return (name.value or b"").decode()

    def next_kernel(self, pd, prefix):
        """Step `pd` on to the first of its kernels whose name starts with `prefix`; False when
        none does (pd is then left on its last kernel)."""
        while not self.implementation(pd).startswith(prefix):
            if self.lib.dnnl_primitive_desc_next_impl(pd) != 0:     # dnnl_last_impl_reached
                return False
        return True

    def primitive(self, pd):
        """The primitive of `pd`, with the memory object and size (float32 values) of the
        scratchpad it takes, if any (Note [scratchpads])."""
        p = _P()
        self.check(self.lib.dnnl_primitive_create(ctypes.byref(p), pd), "creating a primitive")
        self.own("primitive", p)
        md = self.query(pd, _SCRATCHPAD_MD)
        size = -(-self.lib.dnnl_memory_desc_get_size(md) // 4) if md.value else 0
        p.scratchpad = (self.memory(md), size) if size else None
        return p

    def workspace(self, pd):
        """(memory object, buffer) for what `pd`'s forward keeps for its backward, or None: the
        primitive's own, not shared."""
        md = self.query(pd, _WORKSPACE_MD)
        size = self.lib.dnnl_memory_desc_get_size(md) if md.value else 0
        return (self.memory(md), np.empty(size, np.uint8)) if size else None

    def memory(self, md):
        m = _P()
        self.check(self.lib.dnnl_memory_create(ctypes.byref(m), md, self.engine, None),
                   "creating a memory object")
        return self.own("memory", m)

    def size(self, md):
        return self.lib.dnnl_memory_desc_get_size(md) // 4

    def same(self, a, b):
        return bool(self.held_equal(a, b))

    def strided_desc(self, array):
        """The memory descriptor of a float32 numpy view, strides and all."""
        md = _P()
        self.check(self.lib.dnnl_memory_desc_create_with_strides(
            ctypes.byref(md), array.ndim, _Dims(*array.shape), _F32,
            _Dims(*(s // 4 for s in array.strides))), f"describing a {array.shape} view")
        return self.own("memory_desc", md)

    def attr(self, accumulate=False):
        """Primitive attributes with the scratchpad the caller's thread passes in (execute),
        and with `accumulate` a sum post-op (the result is added into the destination).

        Note [scratchpads]: by default oneDNN gives some kernels (GEMM-based convolutions among
        them) a scratchpad held in a thread_local of the thread that created the primitive,
        and looks it up in the thread that executes it: a primitive built on one thread and
        run on another (every lane's) found no buffer there and crashed (SIGSEGV). Every
        primitive here takes the user mode instead: the executing thread lends its own buffer
        (kernels/scratch.py), so no two threads ever share one."""
        attr = _P()
        self.check(self.lib.dnnl_primitive_attr_create(ctypes.byref(attr)), "making attrs")
        self.own("primitive_attr", attr)
        self.check(self.lib.dnnl_primitive_attr_set_scratchpad_mode(attr, _USER_SCRATCHPAD),
                   "choosing the user scratchpad")
        if accumulate:
            ops = _P()
            self.check(self.lib.dnnl_post_ops_create(ctypes.byref(ops)), "making post-ops")
            self.own("post_ops", ops)
            self.check(self.lib.dnnl_post_ops_append_sum(ops, ctypes.c_float(1.0), 0, 0),
                       "adding a sum post-op")
            self.check(self.lib.dnnl_primitive_attr_set_post_ops(attr, ops), "setting post-ops")
        return attr

    def reorder(self, src, dst, accumulate=False):
        """A reorder primitive src -> dst; with `accumulate`, dst += the reordered src."""
        pd = _P()
        self.check(self.lib.dnnl_reorder_primitive_desc_create(
            ctypes.byref(pd), src, self.engine, dst, self.engine, self.attr(accumulate)),
            "planning a reorder")
        return self.primitive(self.own("primitive_desc", pd))

    def execute(self, primitive, args, held=False):
        """Run `primitive` on {argument: (memory object, numpy array)}, with the calling
        thread's scratchpad; `held`: keeping the interpreter lock, for primitives that take a
        few microseconds.

        Small layers run a primitive in tens of microseconds, and this runs while the thread
        holds the interpreter lock the other lanes wait for (lanes.py), so it does only what
        changed: a memory object is pointed at its array again only when given another array
        (a weak reference remembers the last, which an array that died no longer matches), and
        the packed argument list is kept per primitive and memory handles."""
        if primitive.scratchpad is not None:
            memory, size = primitive.scratchpad
            args[SCRATCHPAD] = (memory, scratch_at_least("onednn_scratchpad", size))
        handles = []
        for memory, array in args.values():
            last = getattr(memory, "array", None)
            if last is None or last() is not array:
                self.set_handle(memory, array.ctypes.data)
                memory.array = weakref.ref(array)
            handles.append(memory.value)
        key = (tuple(args), tuple(handles))
        packs = getattr(primitive, "packs", None)
        if packs is None:
            packs = primitive.packs = {}
        packed = packs.get(key)
        if packed is None:
            packed = packs[key] = (_Arg * len(args))(*[_Arg(k, m) for k, m in zip(*key)])
        run = self.held_execute if held else self.lib.dnnl_primitive_execute
        self.check(run(primitive, self.stream, len(args), packed), "running a primitive")
        if not self.synchronous:
            self.check(self.lib.dnnl_stream_wait(self.stream), "waiting for a primitive")


_LIBRARY = None


def library():
    """The loaded library; raises Unavailable (every time) when it cannot be loaded, or Required
    when SYNCSGD_REQUIRE_ONEDNN=1."""
    global _LIBRARY
    if _LIBRARY is None:
        try:
            _LIBRARY = _Library()
        except Unavailable as e:
            _LIBRARY = e
    if isinstance(_LIBRARY, Unavailable):
        if switches.require_onednn():
            raise Required(f"SYNCSGD_REQUIRE_ONEDNN=1 but oneDNN does not load: {_LIBRARY}")
        raise _LIBRARY
    return _LIBRARY


def available():
    try:
        library()
        return True
    except Unavailable:
        return False


def version():
    """The loaded library's version, as "major.minor.patch"."""
    v = library().lib.dnnl_version().contents
    return f"{v.major}.{v.minor}.{v.patch}"


class _Operand:
    """One tensor of a primitive: its plain layout, the layout the primitive chose, and the
    reorder between them (None when they are the same). A tensor is a numpy array, or a Side
    of a blob, which it is read from in a form that fits and written to in one when the blob
    takes forms. An `accumulate` result (a parameter gradient) is added into its array, or
    written over it where the caller's beta is 0 (a cleared diff: Blob.gradient_target)."""

    def __init__(self, lib, plain_shape, chosen, name, into_plain=False, accumulate=False):
        self.lib, self.name, self.shape = lib, name, tuple(plain_shape)
        self.plain, self.chosen = lib.desc(plain_shape), chosen
        self.plain_memory, self.chosen_memory = lib.memory(self.plain), lib.memory(chosen)
        self.size = lib.size(chosen)
        self.held = self.size < HELD_VALUES
        self._from = None       # (form, Reorder from its layout): _reorder_from
        self.same = lib.same(self.plain, chosen)
        self.direct = self.same and not accumulate
        self.convert = self.overwrite = None
        self._form = None
        if not self.direct:
            self.convert = (lib.reorder(chosen, self.plain, accumulate) if into_plain
                            else lib.reorder(self.plain, chosen))
        if accumulate and not self.same:
            self.overwrite = lib.reorder(chosen, self.plain)

    def buffer(self):
        return scratch(f"onednn_{self.name}", (self.size,))

    def load(self, source):
        """(memory, array) holding `source` in the chosen layout."""
        if isinstance(source, Side):
            form = source.blob.form(source.side)
            if form is not None and form.fits(self.shape, self.chosen):
                return form.memory, form.values
            if form is not None and not self.direct and form.shape == self.shape:
                # From the form's layout to the chosen one in one reorder, not two via NCHW.
                buffer = self.buffer()
                self.lib.execute(self._reorder_from(form).primitive,
                                 {SRC: (form.memory, form.values),
                                  DST: (self.chosen_memory, buffer)}, self.held)
                return self.chosen_memory, buffer
            source = source.blob.data if source.side == 0 else source.blob.diff
        if self.direct:
            return self.plain_memory, source
        buffer = self.buffer()
        self.lib.execute(self.convert, {SRC: (self.plain_memory, source),
                                        DST: (self.chosen_memory, buffer)}, self.held)
        return self.chosen_memory, buffer

    def _reorder_from(self, form):
        """The reorder from `form`'s layout to the chosen one, kept while it serves one form
        (a blob writes the same form again at every pass)."""
        if self._from is None or self._from[0]() is not form:
            self._from = (weakref.ref(form), Reorder(form.md, self.chosen))
        return self._from[1]

    def target(self, dest, beta=1.0):
        """(memory, array) for a primitive to write what store() then puts into `dest` (beta 0:
        over it, the primitive writing straight into it where the layouts agree)."""
        if not beta and self.same and not isinstance(dest, Side):
            return self.plain_memory, dest
        if isinstance(dest, Side):
            blob = dest.blob
            if not (blob.takes_forms and not self.direct):
                return self.target(blob.overwrite(dest.side))
            form = blob.spare_form(dest.side)
            if form is None or not form.fits(self.shape, self.chosen):
                form = Form(self.shape, self.chosen)
            self._form = form
            return form.memory, form.values
        return (self.plain_memory, dest) if self.direct else (self.chosen_memory, self.buffer())

    def store(self, written, dest, beta=1.0):
        if isinstance(dest, Side):
            if self._form is not None and written[1] is self._form.values:
                dest.blob.keep(dest.side, self._form)
                self._form = None
                return
            dest = dest.blob.array(dest.side)
        if written[1] is dest:
            return
        convert = self.convert if beta else self.overwrite or self.convert
        if convert is not None:
            self.lib.execute(convert, {SRC: (self.chosen_memory, written[1]),
                                       DST: (self.plain_memory, dest)}, self.held)


def _far_pad(images, maps, kernel, pad, stride, dilation=(1, 1)):
    """oneDNN's right and bottom padding, which makes its output size exact where Caffe rounds
    (down for convolutions; up or down, as round_mode says, for pooling)."""
    return [(o - 1) * s + d * (k - 1) + 1 - i - p for o, s, d, k, i, p in
            zip(maps[2:], stride, dilation, kernel, images[2:], pad)]


def _one_caller(method):
    """`method` of a _Primitives, refused while another thread runs one: the memory objects it
    points at its arrays are the object's own (each lane builds its own layers, and so its own
    primitives), so two threads at once would point them at each other's arrays."""
    @functools.wraps(method)
    def run(self, *args):
        if not self._turn.acquire(blocking=False):
            raise SyncSGDError(f"oneDNN {type(self).__name__} run by two threads at once "
                               f"({threading.current_thread().name} and another); each "
                               "thread must run primitives of its own")
        try:
            return method(self, *args)
        finally:
            self._turn.release()
    return run


class _Primitives:
    """Owns what its _build(*args) makes, freed with it: a layer reshaped to a new batch size
    or share of the cores builds new ones. Raises Unavailable if oneDNN lacks one. Its
    primitives run on one thread at a time (_one_caller), whichever it is."""

    def __init__(self, *args, **kwargs):
        self._handles = []
        self._turn = threading.Lock()
        lib = self.lib = library()
        lib.set_threads()
        start = len(lib.created)
        try:
            self._build(*args, **kwargs)
        finally:
            self._handles = lib.created[start:]
            del lib.created[start:]

    def __del__(self):
        if self._handles:
            self.lib.destroy(self._handles)
            self._handles = []

    def _build(self, *args, **kwargs):
        raise NotImplementedError


class _Tensor(_Primitives):
    """A tensor of `shape` in layout `md` (what Form and Layout share)."""

    def fits(self, shape, md):
        """Whether this holds a `shape` tensor in layout `md`."""
        return tuple(shape) == self.shape and self.lib.same(self.md, md)

    def same_layout(self, other):
        return other.fits(self.shape, self.md)


class Form(_Tensor):
    """A blob's values in the layout a primitive chose, kept between layers that run on oneDNN
    instead of reordering to NCHW after every layer (blob.py): Form(shape, md). `tag` names
    its layout where it is one the layers choose (_Library.tag_of), else None."""

    def _build(self, shape, md):
        lib = self.lib
        clone = _P()
        lib.check(lib.lib.dnnl_memory_desc_clone(ctypes.byref(clone), md), "copying a layout")
        self.md, self.shape = lib.own("memory_desc", clone), tuple(shape)
        self.tag = lib.tag_of(shape, self.md)
        plain = lib.desc(shape)
        self.memory, self._plain_memory = lib.memory(self.md), lib.memory(plain)
        self.values = np.empty(lib.size(self.md), np.float32)   # flat, padding included
        self._to_plain = lib.reorder(self.md, plain)

    @_one_caller
    def to_plain(self, array):
        self.lib.set_threads()
        self.lib.execute(self._to_plain, {SRC: (self.memory, self.values),
                                          DST: (self._plain_memory, array)},
                         self.values.size < HELD_VALUES)


def form_like(blob, side, like):
    """A form of `blob`'s `side` in the layout and shape of the form `like`, for a layer to
    write whole: the blob's last one where it fits, else a new one."""
    form = blob.spare_form(side)
    if form is None or not form.same_layout(like):
        form = Form(like.shape, like.md)
    return form


class Layout(_Tensor):
    """A `shape` tensor in layout `md` (default: the channel-blocked one of this machine's
    convolutions, which the layers around them keep), in a buffer of its own: Layout(shape,
    md=None). put() gives a blob's side its values in this layout; take() returns a blob's side
    in it, reordered into the buffer unless its form already holds it so. A convolution's
    timed choice charges a candidate the take() of its result (layers/convolution.py); Eltwise
    takes its bottoms in its first bottom's layout."""

    def _build(self, shape, md=None):
        lib = self.lib
        self.shape = tuple(shape)
        md = lib.desc(shape, lib.channel_blocks()) if md is None else md
        clone = _P()
        lib.check(lib.lib.dnnl_memory_desc_clone(ctypes.byref(clone), md), "copying a layout")
        self.md = lib.own("memory_desc", clone)
        self.values = np.empty(lib.size(self.md), np.float32)
        self.memory, self._plain = lib.memory(self.md), lib.memory(lib.desc(shape))
        self._from_plain = lib.reorder(lib.desc(shape), self.md)
        self._from = None           # (a form's layout, its reorder) of the last take

    def put(self, blob, side):
        form = Form(self.shape, self.md)
        self.lib.execute(self._from_plain, {SRC: (self._plain, blob.array(side)),
                                            DST: (form.memory, form.values)})
        blob.keep(side, form)

    @_one_caller
    def take(self, blob, side):
        self.lib.set_threads()
        form = blob.form(side)
        if form is None:
            self.lib.execute(self._from_plain, {SRC: (self._plain, blob.array(side)),
                                                DST: (self.memory, self.values)})
        elif form.fits(self.shape, self.md):
            return form.values
        else:
            if self._from is None or not self.lib.same(self._from[0], form.md):
                self._from = (form.md, Reorder(form.md, self.md))
            self.lib.execute(self._from[1].primitive, {SRC: (form.memory, form.values),
                                                       DST: (self.memory, self.values)})
        return self.values


class Gather:
    """Several blobs' sides in one layout, for a layer that combines them elementwise (Eltwise's
    SUM, Split's gradient): the layout of the first that is in a form, the others reordered
    into it where theirs differs (a Layout per position, kept)."""

    def __init__(self):
        self._layouts = {}

    def values(self, blobs, side):
        """(that first form, [each side's flat values in its layout]), or (None, None) when no
        side is in a form."""
        like = next((f for f in (b.form(side) for b in blobs) if f is not None), None)
        if like is None:
            return None, None
        values = []
        for i, blob in enumerate(blobs):
            form = blob.form(side)
            if form is not None and form.same_layout(like):
                values.append(form.values)
                continue
            layout = self._layouts.get(i)
            if layout is None or not like.fits(layout.shape, layout.md):
                layout = self._layouts[i] = Layout(like.shape, like.md)
            values.append(layout.take(blob, side))
        return like, values


class Reorder(_Primitives):
    """A reorder between two layouts of one tensor: Reorder(source md, destination md)."""

    def _build(self, source, destination):
        self.primitive = self.lib.reorder(source, destination)


LAYOUTS = {"any": _ANY, "nhwc": _NHWC}
# A convolution's three directions, in the order of a plan's choices.
DIRECTIONS = ("forward", "image_grad", "weight_grad")


def _convolution_descs(lib, images, maps, kernel, pad, stride, dilation, group, bias, tag,
                       directions=3):
    """The forward, image-gradient and weight-gradient primitive descriptors (the first
    `directions` of them) of a convolution with images and maps in layout `tag`, each on
    oneDNN's first choice of kernel. The backward ones keep a pointer to the forward one (their
    hint), which must then not be stepped to another kernel (next_kernel)."""
    weights = _weights_shape(images, maps, kernel, group)
    geometry = (_Dims(*stride), _Dims(*(d - 1 for d in dilation)), _Dims(*pad),
                _Dims(*_far_pad(images, maps, kernel, pad, stride, dilation)))
    any_weights = lib.desc(weights, _ANY)
    bias_md = lib.desc((maps[1],)) if bias else None
    images_md, maps_md = lib.desc(images, tag), lib.desc(maps, tag)
    forward, backward_data, backward_weights = _P(), _P(), _P()
    lib.check(lib.lib.dnnl_convolution_forward_primitive_desc_create(
        ctypes.byref(forward), lib.engine, _FORWARD_TRAINING, _CONVOLUTION_DIRECT,
        images_md, any_weights, bias_md, maps_md, *geometry, lib.attr()),
        f"planning the convolution {images} -> {maps}")
    lib.own("primitive_desc", forward)
    if directions == 1:
        return (forward,)
    lib.check(lib.lib.dnnl_convolution_backward_data_primitive_desc_create(
        ctypes.byref(backward_data), lib.engine, _CONVOLUTION_DIRECT, images_md,
        any_weights, maps_md, *geometry, forward, lib.attr()),
        "planning its image gradient")
    lib.own("primitive_desc", backward_data)
    lib.check(lib.lib.dnnl_convolution_backward_weights_primitive_desc_create(
        ctypes.byref(backward_weights), lib.engine, _CONVOLUTION_DIRECT, images_md,
        any_weights, bias_md, maps_md, *geometry, forward, lib.attr()),
        "planning its weight gradient")
    lib.own("primitive_desc", backward_weights)
    return forward, backward_data, backward_weights


def _weights_shape(images, maps, kernel, group):
    """Caffe's weights as oneDNN takes them: (outputs, channels, kh, kw), or by group."""
    channels, outputs = images[1], maps[1]
    return (outputs, channels, *kernel) if group == 1 else (
        group, outputs // group, channels // group, *kernel)


class ConvolutionKernels(_Primitives):
    """The kernels oneDNN offers each direction of a convolution, reference kernels left out:
    ConvolutionKernels(images, maps, kernel, pad, stride, dilation, group, bias).names is
    {direction: [(layout, kernel name), ...]}, layouts as in LAYOUTS, best first by oneDNN's
    own ranking; what plans.convolution_candidates offers the timed choice."""

    def _build(self, *geometry):
        lib, self.names = self.lib, {d: [] for d in DIRECTIONS}
        for layout, tag in LAYOUTS.items():
            try:
                pds = _convolution_descs(lib, *geometry, tag)
            except Unavailable:
                continue
            # Each walked descriptor is left on its last kernel; the forward one, the others'
            # hint, last.
            for direction, pd in reversed(list(zip(DIRECTIONS, pds))):
                while True:
                    name = lib.implementation(pd)
                    if not name.startswith("ref"):
                        self.names[direction].append((layout, name))
                    if lib.lib.dnnl_primitive_desc_next_impl(pd) != 0:
                        break


class Convolution(_Primitives):
    """The forward, image-gradient and weight-gradient primitives of one 2-D convolution of
    (num, channels, h, w) images into (num, num_output, out_h, out_w) maps, with Caffe's
    (num_output, channels / group, kh, kw) weights: Convolution(images, maps, kernel, pad,
    stride, dilation, group, bias, channels_last=False, choices=None).
    channels_last (the fixed rules' choice: kernels/plans.py) offers channels-last images and
    maps first, kept where oneDNN's brgemm kernels take them in all three directions (not its
    reference kernels): they do without the padding channel blocks would need. `choices` (the
    timed choice) names each direction's (layout, kernel name prefix) in DIRECTIONS order
    instead; a kernel oneDNN no longer offers falls back to its first choice."""

    def _build(self, images, maps, kernel, pad, stride, dilation, group, bias,
               channels_last=False, choices=None):
        lib = self.lib
        geometry = (images, maps, kernel, pad, stride, dilation, group, bias)
        pds = None
        if choices is not None:
            pds = [self._chosen(geometry, direction, *choice)
                   for direction, choice in enumerate(choices)]
        elif channels_last:
            try:
                pds = _convolution_descs(lib, *geometry, _NHWC)
            except Unavailable:
                pds = None
            names = [lib.implementation(pd) for pd in pds] if pds else []
            if not names or not names[0].startswith("brg") or any(
                    name.startswith("ref") for name in names):
                pds = None
        weights = _weights_shape(images, maps, kernel, group)
        forward, backward_data, backward_weights = pds or _convolution_descs(
            lib, *geometry, _ANY)
        bias_md = lib.desc((maps[1],)) if bias else None
        self.implementation = lib.implementation(forward)
        self.kernels = tuple(lib.implementation(pd)
                             for pd in (forward, backward_data, backward_weights))
        self._forward, self._backward_data, self._backward_weights = (
            lib.primitive(pd) for pd in (forward, backward_data, backward_weights))
        q = lib.query
        self.f_images = _Operand(lib, images, q(forward, _SRC_MD), "images")
        self.f_weights = _Operand(lib, weights, q(forward, _WEIGHTS_MD), "weights")
        self.f_maps = _Operand(lib, maps, q(forward, _DST_MD), "maps", into_plain=True)
        self.d_maps = _Operand(lib, maps, q(backward_data, _DIFF_DST_MD), "maps")
        self.d_weights = _Operand(lib, weights, q(backward_data, _WEIGHTS_MD), "weights")
        self.d_images = _Operand(lib, images, q(backward_data, _DIFF_SRC_MD), "images_grad",
                                 into_plain=True)
        self.w_images = _Operand(lib, images, q(backward_weights, _SRC_MD), "images")
        self.w_maps = _Operand(lib, maps, q(backward_weights, _DIFF_DST_MD), "maps_grad")
        self.w_grad = _Operand(lib, weights, q(backward_weights, _DIFF_WEIGHTS_MD),
                               "weights_grad", into_plain=True, accumulate=True)
        self.bias = lib.memory(bias_md) if bias else None
        self.maps_shape = tuple(maps)
        self.shared_maps_grad = lib.same(self.d_maps.chosen, self.w_maps.chosen)

    def _chosen(self, geometry, direction, layout, prefix):
        """Direction `direction`'s descriptor in `layout`, stepped on to the kernel named
        `prefix` (a fresh first choice where oneDNN does not offer it)."""
        def first():
            return _convolution_descs(self.lib, *geometry, LAYOUTS[layout],
                                      directions=direction + 1)[direction]
        pd = first()
        if prefix and not self.lib.next_kernel(pd, prefix):
            pd = first()
        return pd

    @_one_caller
    def forward(self, images, weights, bias, maps):
        """maps = images * weights (+ bias)."""
        self.lib.set_threads()
        args = {SRC: self.f_images.load(images), WEIGHTS: self.f_weights.load(weights),
                DST: self.f_maps.target(maps)}
        if self.bias is not None:
            args[BIAS] = (self.bias, bias)
        self.lib.execute(self._forward, args)
        self.f_maps.store(args[DST], maps)

    @_one_caller
    def backward(self, images, maps_grad, weights, images_grad, weights_grad, bias_grad):
        """weights_grad and bias_grad, unless None, are (diff, beta) pairs
        (Blob.gradient_target): diff = beta * diff + this batch's parameter gradient;
        images_grad, unless None, = the images' gradient (overwritten). One primitive computes
        both parameter gradients: where only one is wanted, the other goes to scratch."""
        self.lib.set_threads()
        maps = None
        if weights_grad is not None or bias_grad is not None:
            grad, beta = weights_grad or (scratch("onednn_discarded", self.w_grad.shape), 0.0)
            maps = self.w_maps.load(maps_grad)
            args = {SRC: self.w_images.load(images), DIFF_DST: maps,
                    DIFF_WEIGHTS: self.w_grad.target(grad, beta)}
            bias, sums = None, None
            if self.bias is not None:
                bias, bias_beta = bias_grad or (None, 0.0)
                sums = bias if bias is not None and not bias_beta else scratch(
                    "onednn_bias_grad", (self.maps_shape[1],))
                args[DIFF_BIAS] = (self.bias, sums)
            self.lib.execute(self._backward_weights, args)
            self.w_grad.store(args[DIFF_WEIGHTS], grad, beta)
            if bias is not None and sums is not bias:
                bias += sums
        if images_grad is None:
            return
        if maps is None or not self.shared_maps_grad:
            maps = self.d_maps.load(maps_grad)
        args = {DIFF_DST: maps, WEIGHTS: self.d_weights.load(weights),
                DIFF_SRC: self.d_images.target(images_grad)}
        self.lib.execute(self._backward_data, args)
        self.d_images.store(args[DIFF_SRC], images_grad)


class Pooling(_Primitives):
    """Max pooling (Caffe's rule: the first maximum in raster order) or average pooling (divided
    by the part of the window inside the image, Caffe's divisor when there is no padding) of
    (num, channels, h, w) images into maps, on copies in layout `tag` (default: channel-blocked,
    else the layout of the form it will read, which it then reads as it is):
    Pooling(images, maps, kernel, pad, stride, average, tag=None). `kernel` names oneDNN's
    choice."""

    def _build(self, images, maps, kernel, pad, stride, average, tag=None):
        lib = self.lib
        blocks = self.tag = lib.channel_blocks() if tag is None else tag
        blocked_images, blocked_maps = lib.desc(images, blocks), lib.desc(maps, blocks)
        geometry = (_Dims(*stride), _Dims(*kernel), _Dims(0, 0), _Dims(*pad),
                    _Dims(*_far_pad(images, maps, kernel, pad, stride)))
        algorithm = _POOLING_AVERAGE if average else _POOLING_MAX
        forward, backward = _P(), _P()
        lib.check(lib.lib.dnnl_pooling_forward_primitive_desc_create(
            ctypes.byref(forward), lib.engine, _FORWARD_TRAINING, algorithm, blocked_images,
            blocked_maps, *geometry, lib.attr()), f"planning the pooling {images} -> {maps}")
        lib.own("primitive_desc", forward)
        self.kernel = lib.implementation(forward)
        lib.check(lib.lib.dnnl_pooling_backward_primitive_desc_create(
            ctypes.byref(backward), lib.engine, algorithm, blocked_images, blocked_maps,
            *geometry, forward, lib.attr()), "planning its gradient")
        lib.own("primitive_desc", backward)
        self._forward, self._backward = lib.primitive(forward), lib.primitive(backward)
        # Backward reuses forward's buffers: a large layer's blocked images are many MB.
        self.images = _Operand(lib, images, blocked_images, "images")
        self.maps = _Operand(lib, maps, blocked_maps, "maps", into_plain=True)
        self.maps_grad = _Operand(lib, maps, blocked_maps, "maps")
        self.images_grad = _Operand(lib, images, blocked_images, "images", into_plain=True)
        self.workspace = lib.workspace(forward)         # max pooling's argmax

    def _run(self, primitive, args):
        if self.workspace is not None:
            args[WORKSPACE] = self.workspace
        self.lib.execute(primitive, args)

    @_one_caller
    def forward(self, images, maps):
        self.lib.set_threads()
        args = {SRC: self.images.load(images), DST: self.maps.target(maps)}
        self._run(self._forward, args)
        self.maps.store(args[DST], maps)

    @_one_caller
    def backward(self, maps_grad, images_grad):
        """images_grad = the images' gradient (overwritten), from the last forward's argmax."""
        self.lib.set_threads()
        args = {DIFF_DST: self.maps_grad.load(maps_grad),
                DIFF_SRC: self.images_grad.target(images_grad)}
        self._run(self._backward, args)
        self.images_grad.store(args[DIFF_SRC], images_grad)


class LRN(_Primitives):
    """Caffe's LRN, across channels or within a channel (k is then 1), on (num, channels, h, w)
    values in one layout (`md`, a blob's form's): LRN(shape, md, within, size, alpha, beta,
    k). `kernels` names oneDNN's choice (forward, backward): JIT ones for the channel-blocked
    layouts on AVX-512, only the reference kernel for some layouts and ISAs."""

    def _build(self, shape, md, within, size, alpha, beta, k):
        lib = self.lib
        self.shape = tuple(shape)
        clone = _P()
        lib.check(lib.lib.dnnl_memory_desc_clone(ctypes.byref(clone), md), "copying a layout")
        self.md = lib.own("memory_desc", clone)
        algorithm = _LRN_WITHIN if within else _LRN_ACROSS
        settings = (ctypes.c_int64(size), ctypes.c_float(alpha), ctypes.c_float(beta),
                    ctypes.c_float(k))
        forward, backward = _P(), _P()
        lib.check(lib.lib.dnnl_lrn_forward_primitive_desc_create(
            ctypes.byref(forward), lib.engine, _FORWARD_TRAINING, algorithm, self.md, self.md,
            *settings, lib.attr()), f"planning the LRN of {self.shape}")
        lib.own("primitive_desc", forward)
        lib.check(lib.lib.dnnl_lrn_backward_primitive_desc_create(
            ctypes.byref(backward), lib.engine, algorithm, self.md, self.md, self.md, *settings,
            forward, lib.attr()), "planning its gradient")
        lib.own("primitive_desc", backward)
        self.kernels = (lib.implementation(forward), lib.implementation(backward))
        self._forward, self._backward = lib.primitive(forward), lib.primitive(backward)
        self._values = {k: lib.memory(self.md) for k in (SRC, DST, DIFF_SRC, DIFF_DST)}
        self._workspace = lib.workspace(forward)        # the window sums

    def _run(self, primitive, values):
        args = {k: (self._values[k], v) for k, v in values.items()}
        if self._workspace is not None:
            args[WORKSPACE] = self._workspace
        self.lib.execute(primitive, args)

    @_one_caller
    def forward(self, src, dst):
        """dst = the LRN of src (flat arrays of the layout's size)."""
        self.lib.set_threads()
        self._run(self._forward, {SRC: src, DST: dst})

    @_one_caller
    def backward(self, src, diff_dst, diff_src):
        """diff_src = the gradient of the last forward's src."""
        self.lib.set_threads()
        self._run(self._backward, {SRC: src, DIFF_DST: diff_dst, DIFF_SRC: diff_src})


class Normalization(_Primitives):
    """y = scale * (x - mean) / sqrt(variance + eps) + shift for each channel of (num, channels,
    ...) values in one layout (`md`: a blob's form's, or None for plain), in one pass each way:
    Normalization(shape, md, eps, scale, shift), mean and variance given (Caffe's BatchNorm
    with stored statistics; oneDNN's own batch statistics are float32 sums, which BatchNorm
    does not take: layers/batch_norm.py). Caffe's Scale is the case mean 0, variance 1, eps
    0, whose backward gives the scale's and shift's gradients. The values may be one array in
    place (y over x, or the input gradient over the output's)."""

    def _build(self, shape, md, eps, scale, shift):
        lib = self.lib
        self.shape = tuple(shape)
        self.plain = md is None
        md = lib.desc(shape) if md is None else md
        clone = _P()
        lib.check(lib.lib.dnnl_memory_desc_clone(ctypes.byref(clone), md), "copying a layout")
        self.md = lib.own("memory_desc", clone)
        self.scale, self.shift = scale, shift
        flags = _GLOBAL_STATS | (_USE_SCALE if scale else 0) | (_USE_SHIFT if shift else 0)
        forward, backward = _P(), _P()
        lib.check(lib.lib.dnnl_batch_normalization_forward_primitive_desc_create(
            ctypes.byref(forward), lib.engine, _FORWARD_TRAINING, self.md, self.md,
            ctypes.c_float(eps), ctypes.c_uint(flags), lib.attr()),
            f"planning a normalisation of {self.shape}")
        lib.own("primitive_desc", forward)
        lib.check(lib.lib.dnnl_batch_normalization_backward_primitive_desc_create(
            ctypes.byref(backward), lib.engine, _BACKWARD if scale or shift else _BACKWARD_DATA,
            self.md, self.md, self.md, ctypes.c_float(eps), ctypes.c_uint(flags), forward,
            lib.attr()), "planning its gradient")
        lib.own("primitive_desc", backward)
        self._forward, self._backward = lib.primitive(forward), lib.primitive(backward)
        channels = lib.desc((shape[1],))
        self._values = {k: lib.memory(self.md) for k in (SRC, DST, DIFF_SRC, DIFF_DST)}
        self._vectors = {k: lib.memory(channels)
                         for k in (MEAN, VARIANCE, SCALE, SHIFT, DIFF_SCALE, DIFF_SHIFT)}

    def fits(self, shape, md):
        """Whether this runs on `shape` values in layout `md` (None: plain)."""
        if md is None:
            return self.plain and tuple(shape) == self.shape
        return tuple(shape) == self.shape and self.lib.same(self.md, md)

    def _args(self, values, vectors):
        args = {k: (self._values[k], v) for k, v in values.items()}
        args.update((k, (self._vectors[k], v)) for k, v in vectors.items() if v is not None)
        return args

    @_one_caller
    def forward(self, src, dst, mean, variance, scale=None, shift=None):
        """dst = the normalised src (flat arrays of the layout's size, possibly one)."""
        self.lib.set_threads()
        self.lib.execute(self._forward, self._args(
            {SRC: src, DST: dst},
            {MEAN: mean, VARIANCE: variance, SCALE: scale, SHIFT: shift}))

    @_one_caller
    def backward(self, src, diff_dst, diff_src, mean, variance, scale=None, diff_scale=None,
                 diff_shift=None):
        """diff_src = the gradient of src (over diff_dst where they are one array); with scale
        and shift, their gradients are written into diff_scale and diff_shift."""
        self.lib.set_threads()
        self.lib.execute(self._backward, self._args(
            {SRC: src, DIFF_DST: diff_dst, DIFF_SRC: diff_src},
            {MEAN: mean, VARIANCE: variance, SCALE: scale,
             DIFF_SCALE: diff_scale if self.scale else None,
             DIFF_SHIFT: diff_shift if self.shift else None}))


class MatMul(_Primitives):
    """out = a @ b (+ out, with `accumulate`) for 2-D float32 arrays of fixed shapes and strides,
    or 3-D ones (a batch of products: blas.batched_gemm), transposed views included (they are
    strides to oneDNN, not copies):
    MatMul(a, b, out, accumulate, kernel=None). Where oneDNN's own GEMM kernels outrun numpy's
    BLAS, and whatever OpenBLAS kernel the environment selects.

    oneDNN offers a product several kernels, best first by its own ranking; `kernel` names
    (by prefix) another to run where oneDNN offers it, such as GEMM_KERNEL, and `self.kernel`
    is the name of the one that runs."""

    def _build(self, a, b, out, accumulate, kernel=None):
        lib = self.lib
        descs = [lib.strided_desc(x) for x in (a, b, out)]
        attr = lib.attr(accumulate)

        def plan():
            pd = _P()
            lib.check(lib.lib.dnnl_matmul_primitive_desc_create(
                ctypes.byref(pd), lib.engine, descs[0], descs[1], None, descs[2], attr),
                f"planning the product {a.shape} @ {b.shape}")
            return lib.own("primitive_desc", pd)
        pd = plan()
        if kernel is not None and not lib.next_kernel(pd, kernel):
            pd = plan()       # walked past the last kernel: back to oneDNN's first choice
        self.kernel = lib.implementation(pd)
        self._primitive = lib.primitive(pd)
        self._memories = [lib.memory(md) for md in descs]

    @_one_caller
    def __call__(self, a, b, out):
        self.lib.set_threads()
        self.lib.execute(self._primitive, {SRC: (self._memories[0], a),
                                           WEIGHTS: (self._memories[1], b),
                                           DST: (self._memories[2], out)})
        return out
