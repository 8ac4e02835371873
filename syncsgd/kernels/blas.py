"""GEMM for the layers: Caffe's caffe_cpu_gemm (C = alpha A B + beta C) on numpy's own BLAS, and
the thread pool that shares work out over the process's thread budget (threads.py).

Two things numpy's matmul cannot do and the layers need:
- accumulate (beta = 1): parameter gradients are added into their diff, with no temporary the
  size of the weights and no second pass over them;
- survive a shared machine. OpenBLAS's own threads synchronise many times inside one product
  and spin while they wait, so when another process holds a core they wait for whole scheduler
  time slices (docs/performance.md, "GEMM on a shared machine"). Here BLAS always runs on one
  thread per call, and a large product is cut into independent pieces that the budget's
  threads take in turn (`spread`); they meet once per product and sleep, not spin, while they
  wait.

Which kernel runs a product is plans.plan_gemm's choice (the thresholds, and why, are there):
oneDNN's matmul for large products where it loaded, cblas_sgemm through ctypes when numpy's
BLAS is the OpenBLAS numpy ships (64-bit integers, `scipy_` or plain symbol names), split over
the threads or not, holding the interpreter lock for small ones; otherwise matmul plus an add
does the same work on numpy's default threads.
"""
import ctypes
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np

from syncsgd import switches
from syncsgd.kernels.threads import budget, shared_out, timed_held

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112
_F4 = np.dtype(np.float32).itemsize


class _Blas:
    """numpy's OpenBLAS: its sgemm and thread count, or None where they cannot be found."""

    def __init__(self):
        self.sgemm = self.held_sgemm = self.get_threads = self.set_threads = None
        self.saxpy = self.sscal = self.scopy = None
        try:
            from threadpoolctl import ThreadpoolController
            paths = [c.filepath for c in
                     ThreadpoolController().select(internal_api="openblas").lib_controllers]
        except Exception:     # threadpoolctl missing or failing: plain numpy, default threads
            return
        for path in paths:
            # Calls through a CDLL let other threads run Python meanwhile; a PyDLL's keep the
            # interpreter lock, which costs less than handing it over and back (lanes.py) for
            # the thread settings and for small products (plans.plan_gemm's `held`).
            lib, held = ctypes.CDLL(path), ctypes.PyDLL(path)
            for prefix, suffix in (("scipy_", "64_"), ("", "64_")):
                name = f"{prefix}cblas_sgemm{suffix}"
                get = getattr(held, f"{prefix}openblas_get_num_threads{suffix}", None)
                put = getattr(held, f"{prefix}openblas_set_num_threads{suffix}", None)
                if getattr(lib, name, None) is None or get is None or put is None:
                    continue
                i64, f32, ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
                fns = getattr(lib, name), getattr(held, name)
                for fn in fns:
                    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, i64, i64, i64, f32,
                                   ptr, i64, ptr, i64, f32, ptr, i64]
                    fn.restype = None
                get.restype, get.argtypes = ctypes.c_int, []
                put.restype, put.argtypes = None, [ctypes.c_int]
                self.sgemm, self.get_threads, self.set_threads = fns[0], get, put
                self.held_sgemm = fns[1]
                if switches.checks():
                    self.held_sgemm = timed_held(fns[1], "a cblas_sgemm")
                self._bind_level1(lib, prefix, suffix)
                return

    def _bind_level1(self, lib, prefix, suffix):
        """saxpy, sscal and scopy (raw addresses, unit strides), where the library has all three."""
        i64, f32, ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
        names = [f"{prefix}cblas_{name}{suffix}" for name in ("saxpy", "sscal", "scopy")]
        if any(getattr(lib, name, None) is None for name in names):
            return
        axpy, scal, copy = (getattr(lib, name) for name in names)
        axpy.argtypes = [i64, f32, ptr, i64, ptr, i64]
        scal.argtypes = [i64, f32, ptr, i64]
        copy.argtypes = [i64, ptr, i64, ptr, i64]
        for fn in (axpy, scal, copy):
            fn.restype = None
        self.saxpy, self.sscal, self.scopy = axpy, scal, copy


_BLAS = None


def _blas():
    global _BLAS
    if _BLAS is None:
        _BLAS = _Blas()
    return _BLAS


def _operand(a):
    """(transpose flag, leading dimension) of a 2-D float32 view BLAS can read in place, or None."""
    s0, s1 = a.strides
    rows, cols = a.shape
    if s1 == _F4 and s0 >= _F4 * max(cols, 1) and s0 % _F4 == 0:
        return _NO_TRANS, s0 // _F4
    if s0 == _F4 and s1 >= _F4 * max(rows, 1) and s1 % _F4 == 0:
        return _TRANS, s1 // _F4
    return None


def _address(a):
    return a.ctypes.data


_POOL = {"workers": 0, "executor": None}
_POOL_LOCK = threading.Lock()     # several threads may start shared-out work at once


def _forget_pool():
    """A forked child has none of its parent's threads: it starts a pool of its own."""
    _POOL["workers"], _POOL["executor"] = 0, None


os.register_at_fork(after_in_child=_forget_pool)


def _executor(workers):
    with _POOL_LOCK:
        if _POOL["workers"] < workers:
            if _POOL["executor"] is not None:
                _POOL["executor"].shutdown(wait=False)
            _POOL["executor"] = ThreadPoolExecutor(workers, thread_name_prefix="syncsgd-gemm")
            _POOL["workers"] = workers
        return _POOL["executor"]


def _bounds(length, parts, align):
    """(start, stop) of `parts` pieces of range(length), starting at multiples of `align`."""
    step = -(-length // parts)
    step = -(-step // align) * align
    return [(i, min(i + step, length)) for i in range(0, length, step)]


def gemm(a, b, out, beta=0.0, alpha=1.0):
    """out = alpha * a @ b + beta * out for 2-D float32 arrays; a and b may be transposed views,
    out is written in place (beta 0: its old values are ignored, as in BLAS). Each thread plans a
    product once per shapes, strides, dtypes and factors (plans.plan_gemm), and keeps the plan
    and its oneDNN primitive."""
    m, k = a.shape
    n = b.shape[1]
    if b.shape[0] != k or out.shape != (m, n):
        raise ValueError(f"gemm shapes {a.shape} @ {b.shape} -> {out.shape} do not match")
    if m == 0 or n == 0:
        return out
    products = _thread_products()
    key = _product_key(a, b, out, beta, alpha)
    product = products.get(key)
    if product is None:
        product = _Product(a, b, out, beta, alpha, key[-2])
        _keep(products, key, product)
    product.run(a, b, out)
    return out


_PRODUCTS = threading.local()     # each thread's products: oneDNN's hold memory objects
_PRODUCT_CACHE = 256    # products kept per thread: a net's shapes, with room for a few batch sizes
_PLANNING = {"thresholds": None, "generation": 0}


def _product_key(a, b, out, beta, alpha):
    return (a.shape, a.strides, b.shape, b.strides, out.shape, out.strides, a.dtype, b.dtype,
            out.dtype, beta, alpha, budget(), _PLANNING["generation"])


class planned_with:
    """gemm plans its products with other thresholds (a plans.Thresholds) inside the block: for
    tools that time one kernel against another."""

    def __init__(self, thresholds):
        self.thresholds = thresholds

    def __enter__(self):
        self.saved = _PLANNING["thresholds"]
        _PLANNING["thresholds"] = self.thresholds
        _PLANNING["generation"] += 1

    def __exit__(self, *exc):
        _PLANNING["thresholds"] = self.saved
        _PLANNING["generation"] += 1


class _Product:
    """One product as plans.plan_gemm planned it or a timed choice chose (tuning.py), for
    operands of fixed shapes, strides and dtypes: `run(a, b, out)` computes it. `plan` forces
    a GemmPlan (what timing runs); `provisional`: planned by the rules only because another
    timing was under way, so not to be kept."""

    def __init__(self, a, b, out, beta, alpha, threads, plan=None):
        from syncsgd.kernels import onednn, plans
        self.alpha, self.beta = alpha, beta
        operands = (_operand(a), _operand(b), _operand(out))
        f32 = a.dtype == b.dtype == out.dtype == np.float32
        self.operands = operands if f32 and None not in operands else None
        layouts = None if self.operands is None else tuple(
            "N" if trans == _NO_TRANS else "T" for trans, _ in operands)

        def build(plan):
            if plan.kernel != "onednn":
                return None
            return onednn.MatMul(a, b, out, beta, kernel=plan.onednn_kernel)
        thresholds = _PLANNING["thresholds"] or plans.THRESHOLDS
        m, k = a.shape
        n = b.shape[1]
        self.provisional = False
        blas_available = _blas().sgemm is not None
        if plan is None and _PLANNING["thresholds"] is None and switches.timed_kernels():
            plan = self._timed(a, b, out, beta, alpha, threads, layouts, blas_available,
                               thresholds)
        if plan is not None:
            self.plan, self.matmul = plan, build(plan)
        else:
            self.plan, self.matmul = plans.choose(
                plans.plan_gemm, build, m, k, n, alpha, beta, layouts, threads, blas_available,
                thresholds=thresholds)
        kernel, split = self.plan.kernel, self.plan.split
        self.run = {"onednn": self.matmul, "numpy": self._numpy}.get(kernel) or getattr(
            self, f"_{split}")
        length = {"columns": n, "rows": m, "sum": k}.get(split)
        self.bounds = length and _bounds(length, threads * thresholds.pieces_per_thread,
                                         plans.ALIGN)

    def _timed(self, a, b, out, beta, alpha, threads, layouts, blas_available, thresholds):
        """The GemmPlan a timed choice gives this product, or None for the fixed rules (no
        choice to make, or another timing under way and none made before: then
        provisional)."""
        from syncsgd.kernels import onednn, plans, tuning
        m, k = a.shape
        n = b.shape[1]
        candidates = plans.gemm_candidates(m, k, n, alpha, beta, layouts, threads,
                                           blas_available, onednn.available(), thresholds)
        if candidates is None:
            return None
        key = {"product": [m, k, n], "layouts": layouts, "alpha": alpha, "beta": beta,
               "threads": threads}
        if tuning.busy():
            made = tuning.cached(key, {"product": candidates})
            if made is not None:
                return plans.GemmPlan(**made["product"])
            self.provisional = True
            return None
        # Timed runs write into a copy of out, in its layout.
        target = np.array(out, order="K")

        def prepare(direction, candidate):
            try:
                product = _Product(a, b, target, beta, alpha, threads,
                                   plans.GemmPlan(**candidate))
            except onednn.Unavailable:
                return None
            return lambda: product.run(a, b, target)
        chosen = tuning.choice(key, {"product": candidates}, prepare, f"product {m}x{k}x{n}")
        return plans.GemmPlan(**chosen["product"])

    def _numpy(self, a, b, out):
        _numpy_gemm(a, b, out, self.alpha, self.beta)

    def _none(self, a, b, out):
        with _one_thread:
            _sgemm(a, b, out, self.alpha, self.beta, self.operands, self.plan.held)

    def _columns(self, a, b, out):
        pieces = [(a, b[:, j0:j1], out[:, j0:j1]) for j0, j1 in self.bounds]
        spread(pieces, lambda piece, worker: _sgemm(*piece, self.alpha, self.beta),
               self.plan.threads)

    def _rows(self, a, b, out):
        pieces = [(a[i0:i1], b, out[i0:i1]) for i0, i1 in self.bounds]
        spread(pieces, lambda piece, worker: _sgemm(*piece, self.alpha, self.beta),
               self.plan.threads)

    def _sum(self, a, b, out):
        """A small output from a long sum (a weight gradient): each thread adds its pieces of
        the sum into its own matrix (the first into out), and the matrices are added at the
        end."""
        if self.beta == 0.0:
            out.fill(0)      # as BLAS: with beta 0 the old values (even NaN) do not matter
        elif self.beta != 1.0:
            out *= np.float32(self.beta)
        share = self.plan.threads
        sums = [out] + [np.zeros_like(out, order="C") for _ in range(share - 1)]
        spread_dealt(self.bounds, lambda span, group: _sgemm(
            a[:, span[0]:span[1]], b[span[0]:span[1]], sums[group], self.alpha, 1.0), share)
        for extra in sums[1:]:
            out += extra


def batched_gemm(a, b, out, beta=0.0):
    """out[i] = a[i] @ b[i] + beta * out[i] for 3-D float32 arrays, a batch of equal products
    (each as gemm takes its operands): on one oneDNN primitive over the batch or a gemm each,
    as plans.batched_gemm_candidates allows and a timed choice finds faster. Each thread keeps
    its own, as gemm does."""
    count, m, k = a.shape
    n = b.shape[2]
    if b.shape[:2] != (count, k) or out.shape != (count, m, n):
        raise ValueError(f"batched gemm shapes {a.shape} @ {b.shape} -> {out.shape} do not match")
    products = _thread_products()
    key = ("batched",) + _product_key(a, b, out, beta, 1.0)
    product = products.get(key)
    if product is None:
        product = _Batched(a, b, out, beta, key[-2])
        _keep(products, key, product)
    product.run(a, b, out)
    return out


def _thread_products():
    """This thread's products (and batches of products)."""
    products = getattr(_PRODUCTS, "cache", None)
    if products is None:
        products = _PRODUCTS.cache = {}
    return products


def _keep(products, key, product):
    if not product.provisional:
        if len(products) >= _PRODUCT_CACHE:
            products.clear()
        products[key] = product


class _Batched:
    """One batch of products for operands of fixed shapes and strides: `run(a, b, out)`."""

    def __init__(self, a, b, out, beta, threads):
        from syncsgd.kernels import onednn, plans, tuning
        self.beta = beta
        self.provisional = False
        count, m, k = a.shape
        n = b.shape[2]
        f32 = a.dtype == b.dtype == out.dtype == np.float32
        candidates = plans.batched_gemm_candidates(
            count, m, k, n, beta, out.strides[2] == _F4, f32 and onednn.available(),
            _PLANNING["thresholds"] or plans.THRESHOLDS)

        def build(kernel, target=out):
            if kernel == "loop":
                return self._loop
            try:
                return onednn.MatMul(a, b, target, beta)
            except onednn.Unavailable:
                return None
        kernel = candidates[0]
        if len(candidates) > 1 and _PLANNING["thresholds"] is None and switches.timed_kernels():
            key = {"batched": [count, m, k, n], "beta": beta, "threads": threads,
                   "layouts": [_layout(x) for x in (a, b, out)]}
            if tuning.busy():
                made = tuning.cached(key, {"product": candidates})
                self.provisional = made is None
                kernel = made["product"] if made else kernel
            else:
                target = np.array(out, order="K")     # timed runs write into a copy

                def prepare(direction, candidate):
                    run = build(candidate, target)
                    return run and (lambda: run(a, b, target))
                kernel = tuning.choice(key, {"product": candidates}, prepare,
                                       f"batched product {count}x{m}x{k}x{n}")["product"]
        self.run = build(kernel) or self._loop

    def _loop(self, a, b, out):
        for i in range(a.shape[0]):
            gemm(a[i], b[i], out[i], self.beta)


def _layout(x):
    """"N" where a matrix of the batch is read along its rows, else "T"."""
    return "N" if x.strides[2] == _F4 else "T"


def onednn_kernel(a, b, out, beta=0.0):
    """The name of the oneDNN kernel this thread's gemm ran the product on, None if it ran
    elsewhere or has not run."""
    product = getattr(_PRODUCTS, "cache", {}).get(_product_key(a, b, out, beta, 1.0))
    return product.matmul.kernel if product is not None and product.matmul else None


def level1():
    """numpy's OpenBLAS's saxpy, sscal and scopy as (axpy, scal, copy) on raw addresses with unit
    strides: axpy(n, alpha, x, 1, y, 1) is y += alpha * x, scal(n, alpha, x, 1) is x *= alpha,
    copy(n, x, 1, y, 1) is y = x. None where they cannot be found. Call them from `spread`'s
    work (which runs OpenBLAS on one thread a call), even on one thread: OpenBLAS would
    otherwise share out long vectors to its own spinning threads."""
    blas = _blas()
    return None if blas.saxpy is None else (blas.saxpy, blas.sscal, blas.scopy)


class _OneThread:
    """OpenBLAS on one thread while any thread is inside (`with _one_thread:`): its thread count
    is one setting for the whole process, so the first thread in sets it to 1 and the last out
    restores it, under a lock (its own threads spin, and split work runs here on ours)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._inside = 0
        self._saved = 1

    def __enter__(self):
        with self._lock:
            if not self._inside:
                blas = _blas()
                self._saved = blas.get_threads() if blas.get_threads is not None else 1
                if self._saved > 1:
                    blas.set_threads(1)
            self._inside += 1

    def __exit__(self, *exc):
        with self._lock:
            self._inside -= 1
            if not self._inside and self._saved > 1:
                _blas().set_threads(self._saved)


_one_thread = _OneThread()


def _sgemm(a, b, out, alpha, beta, operands=None, held=False):
    """One cblas_sgemm call on views _operand accepts (`operands`: theirs, when known); `held`:
    keeping the interpreter lock (plans.plan_gemm's choice for small products)."""
    m, k = a.shape
    n = b.shape[1]
    (ta, lda), (tb, ldb), (to, ldc) = operands or (_operand(a), _operand(b), _operand(out))
    blas = _blas()
    fn = blas.held_sgemm if held else blas.sgemm
    if to == _NO_TRANS:
        fn(_ROW_MAJOR, ta, tb, m, n, k, alpha, _address(a), lda, _address(b), ldb,
           beta, _address(out), ldc)
    else:
        # out is column-major: compute out.T = b.T @ a.T in row-major terms.
        flip = {_NO_TRANS: _TRANS, _TRANS: _NO_TRANS}
        fn(_ROW_MAJOR, flip[tb], flip[ta], n, m, k, alpha, _address(b), ldb,
           _address(a), lda, beta, _address(out), ldc)


def _numpy_gemm(a, b, out, alpha, beta):
    if beta == 0.0:
        np.matmul(a, b, out=out)
        if alpha != 1.0:
            out *= np.float32(alpha)
        return out
    product = a @ b
    if alpha != 1.0:
        product *= np.float32(alpha)
    if beta != 1.0:
        out *= np.float32(beta)
    out += product
    return out


def openblas_threads():
    """OpenBLAS's own thread setting (until set: its environment, else the cores)."""
    blas = _blas()
    return blas.get_threads() if blas.get_threads is not None else 1


def spread(items, work, share=None):
    """work(item, worker) for every item, on `share` threads (default: the thread budget): this
    one (worker 0) and share - 1 of a pool, each taking the next item when it has finished one,
    so a thread held back by other load on the machine simply does fewer. Kernels called from
    `work` run on one thread. `items` must not contain None."""
    share = min(share or budget(), len(items))
    with _one_thread:
        if share <= 1:
            with shared_out():
                for item in items:
                    work(item, 0)
            return
        lock = threading.Lock()
        queue = iter(items)

        failed = threading.Event()

        def drain(worker):
            with shared_out():
                while not failed.is_set():
                    with lock:
                        item = next(queue, None)
                    if item is None:
                        return
                    try:
                        work(item, worker)
                    except BaseException:
                        failed.set()          # the other threads take no new items
                        raise
        futures = [_executor(share - 1).submit(drain, w) for w in range(1, share)]
        try:
            drain(0)
        finally:
            # No worker may still run shared-out work once this returns or raises. One that
            # has not woken yet finds nothing left: it is called off instead of waited for
            # (waking a thread costs about 0.1 ms: docs/performance.md, "Lanes: a pass in one
            # hand-off").
            futures = [future for future in futures if not future.cancel()]
            wait(futures)
        for future in futures:
            future.result()


def spread_dealt(items, work, share=None):
    """work(item, group) for every item, the items dealt round-robin into `share` groups (default:
    the thread budget) that run on the threads as `spread` runs items: each group's
    items in order on one thread. What a group adds into a buffer of its own is then the same
    in every run, whichever thread took it: sums of floating-point pieces do not depend on
    timing (bit-identical reruns)."""
    share = max(1, min(share or budget(), len(items)))
    groups = [items[g::share] for g in range(share)]
    spread(list(range(share)), lambda g, worker: [work(item, g) for item in groups[g]], share)


def all_finite(array):
    """Whether every value of a float32 array is finite. A piece's sum of squares (a BLAS dot
    product; the pieces shared out to the threads) is finite exactly when its values are,
    unless large values overflow it: only then are they tested one by one. A memory-bound
    pass; numpy's sum reads at about half the rate (docs/performance.md, "Elementwise
    passes")."""
    flat = array.reshape(-1)
    sums = []

    def add(piece):
        with np.errstate(over="ignore", invalid="ignore"):    # numpy's state is per thread
            sums.append(float(np.dot(flat[piece], flat[piece])))
    in_pieces(add, flat.size, 1 << 20)
    return all(map(math.isfinite, sums)) or bool(np.isfinite(flat).all())


def on_pieces(work, *arrays):
    """work(*pieces) over the same flat pieces of equally sized arrays (`in_pieces`), or once
    on the whole arrays where one is not contiguous (whose flat view would be a copy)."""
    if not all(a.flags.c_contiguous for a in arrays):
        work(*arrays)
        return
    flat = [a.reshape(-1) for a in arrays]
    in_pieces(lambda p: work(*(a[p] for a in flat)), flat[0].size)


def in_pieces(work, size, piece=1 << 18):
    """work(piece) for the flat slices of `piece` values that cover `size`, shared out to the
    process's threads (`spread`): memory-bound elementwise passes gain from the second core
    once each piece's operands stay in cache."""
    pieces = [slice(i, i + piece) for i in range(0, size, piece)]
    if len(pieces) <= 1:
        work(slice(0, size))
    else:
        spread(pieces, lambda p, _: work(p))
