"""The layer graph: builds layers from a compiled NetParameter and runs forward and backward.

The Net knows the order of layers and which blobs connect them, never a layer's insides. Hooks let
the distributed reducer act between layers (start a reduction after a layer's backward, wait for
an update before a layer's forward) without the net knowing about MPI (docs/method.md,
"Overlapping communication").
"""
import time
from collections import OrderedDict
from itertools import zip_longest

import numpy as np
from google.protobuf import text_format

from syncsgd import TEST, TRAIN, log, switches
from syncsgd.blob import Blob
from syncsgd.compile import compile_net
from syncsgd.context import Context
from syncsgd.errors import FillerError, PrototxtError, ShapeError
from syncsgd.layers import create
from syncsgd.layers.registry import is_known, layer_class
from syncsgd.lanes import LaneRunner

_PHASES = {TRAIN: "TRAIN", TEST: "TEST"}


class ParamInfo:
    """One learnable parameter blob as the solver sees it."""

    def __init__(self, blob, layer_name, index, lr_mult, decay_mult, name="", part=None):
        self.blob = blob
        self.part = part            # a layers.base.Part when this rank holds a slice
        self.layer_name = layer_name
        self.index = index
        self.lr_mult = lr_mult
        self.decay_mult = decay_mult
        self.name = name

    def __repr__(self):
        return f"ParamInfo({self.layer_name}[{self.index}], shape={self.blob.shape})"


class Net:
    """pycaffe's Net: Net(model, phase), Net(model, weights, phase) or keyword forms.

    `model` is a prototxt path or a NetParameter. `ctx` (a Context) is given by a solver that
    trains over several ranks; otherwise a one-process context is made. `transform` rewrites the
    compiled NetParameter before layers are built (the distributed partitioner).
    """

    def __init__(self, model, *args, phase=None, weights=None, level=0, stages=(), ctx=None,
                 transform=None):
        if len(args) == 1:
            if isinstance(args[0], int):
                phase = args[0]
            else:
                weights = args[0]
        elif len(args) == 2:
            weights, phase = args
        elif args:
            raise TypeError("Net(model, phase) or Net(model, weights, phase)")
        if phase is None:
            phase = ctx.phase if ctx is not None else TEST
        if phase not in (TRAIN, TEST):
            raise ValueError(f"phase must be syncsgd.TRAIN or syncsgd.TEST, got {phase!r}")
        self.phase = phase
        self.ctx = ctx if ctx is not None else Context(phase)
        self.param, self.source = compile_net(model, phase, level, stages)
        if transform is not None:
            self.param = transform(self.param)
        self.name = self.param.name
        self.blobs = OrderedDict()
        self.layers = []
        self.layer_dict = OrderedDict()
        self.bottom_vecs, self.top_vecs = [], []
        self.bottom_need_backward, self.layer_need_backward = [], []
        self.loss_weights = []      # per layer: list of weights, one per top
        self._loss_weight_of = {}   # top blob name -> its loss weight, where not zero
        self.learnable_params = []  # ParamInfo of each distinct learnable blob, in net order
        self.forward_hooks, self.backward_hooks = [], []
        self.timeline = None        # a syncsgd.parallel.timeline.Timeline recording layer spans
        self.debug_info = self.param.debug_info   # Caffe's per-layer mean |data| / |diff| lines
        self._build()
        self.lanes = LaneRunner(self)
        self._fusions = self._fuse()
        if weights is not None:
            self.copy_from(weights)

    # -- construction -----------------------------------------------------------------------
    def _build(self):
        if log.enabled():
            log.info("Initializing net from parameters: \n" + _param_text(self.param))
        param_owner = {}
        consumed = set()
        inputs = []
        blob_need_backward = {}
        memory = 0
        forms = _taking_forms((layer_class(lp.type).forms_for(lp, self.phase),
                               list(lp.bottom) + list(lp.top))
                              for lp in self.param.layer if is_known(lp.type))
        for lp in self.param.layer:
            where = f"{self.source}: layer '{lp.name}': "
            layer = create(lp, self.ctx, where)
            log.info(f"Creating Layer {lp.name}")
            for name in lp.bottom:
                log.info(f"{lp.name} <- {name}")
            bottom = [self.blobs[name] for name in lp.bottom]
            consumed.update(lp.bottom)
            top = []
            for j, name in enumerate(lp.top):
                if j < len(lp.bottom) and name == lp.bottom[j]:
                    if not layer.in_place_ok:
                        raise PrototxtError(f"{where}a {lp.type} layer cannot run in place (its "
                                            f"top '{name}' is its bottom); give the top its own "
                                            "name")
                    log.info(f"{lp.name} -> {name} (in-place)")
                    top.append(self.blobs[name])          # in place
                    consumed.discard(name)        # produced again: an output if last (Caffe)
                elif name in self.blobs:
                    raise PrototxtError(f"{where}top blob '{name}' is already produced by an "
                                        "earlier layer; give it a new name, or make the layer "
                                        "in place (top equal to its bottom at the same index)")
                else:
                    log.info(f"{lp.name} -> {name}")
                    blob = Blob(name=name)
                    blob.takes_forms = name in forms      # for layers timing their kernels
                    self.blobs[name] = blob
                    top.append(blob)
                    consumed.discard(name)
            if layer.is_loss and not lp.top:
                top.append(Blob(name=f"({lp.name} loss)"))   # Caffe's automatic loss top
            try:
                layer.check_counts(bottom, top)
                layer.setup(bottom, top)
                self._reshape_layer(layer, bottom, top)
            except ShapeError as e:
                raise ShapeError(f"{self.source}: {e} (bottom shapes "
                                 f"{[tuple(b.shape) for b in bottom]})") from None
            except FillerError as e:
                raise PrototxtError(f"{where}{e}") from None
            if lp.type == "Input":
                inputs.extend(lp.top)
            self._copy_layer_blobs(layer, lp, where)
            weights = self._layer_loss_weights(layer, lp, where, len(top))
            memory += _log_setup(lp.name, top, weights)
            log.info(f"Memory required for data: {memory}")
            self.loss_weights.append(weights)
            self._loss_weight_of.update((n, w) for n, w in zip(lp.top, weights) if w)
            need = self._append_params(layer, param_owner, where)
            if lp.propagate_down and len(lp.propagate_down) != len(lp.bottom):
                raise PrototxtError(f"{where}propagate_down has {len(lp.propagate_down)} "
                                    f"values but the layer has {len(lp.bottom)} bottoms")
            bottom_need = []
            for j, name in enumerate(lp.bottom):
                # Caffe's AppendBottom: propagate_down, where given, decides for the bottom.
                need = need or blob_need_backward.get(name, False)
                bottom_need.append(lp.propagate_down[j] if lp.propagate_down
                                   else blob_need_backward.get(name, False))
            for name in lp.top:
                blob_need_backward[name] = blob_need_backward.get(name, False) or need
            self.layers.append(layer)
            self.layer_dict[lp.name] = layer
            self.bottom_vecs.append(bottom)
            self.top_vecs.append(top)
            self.bottom_need_backward.append(bottom_need)
            self.layer_need_backward.append(need)
        self.inputs = inputs
        self.outputs = sorted(name for name in self.blobs if name not in consumed)
        self._mark_forms()
        self._mark_read_only_tops()
        self._mark_rewritten_tops()
        self._mark_kept_bottoms()
        self._prune_backward()
        for i in reversed(range(len(self.layers))):
            need = "needs" if self.layer_need_backward[i] else "does not need"
            log.info(f"{self.layers[i].name} {need} backward computation.")
        for name in self.outputs:
            log.info(f"This network produces output {name}")
        log.info("Network initialization done.")

    def _copy_layer_blobs(self, layer, lp, where):
        """Weights given inside the prototxt (`blobs { }`) replace the filled ones, as in Caffe."""
        if not lp.blobs:
            return
        from syncsgd.weights import blob_array
        if len(lp.blobs) != len(layer.blobs):
            raise PrototxtError(f"{where}has {len(lp.blobs)} blobs in the prototxt but the layer "
                                f"makes {len(layer.blobs)}")
        for k, proto in enumerate(lp.blobs):
            layer.blobs[k].data[...] = blob_array(proto, layer.blobs[k].shape, f"{where}blob {k}")

    def _layer_loss_weights(self, layer, lp, where, n):
        if lp.loss_weight:
            if len(lp.loss_weight) != n:
                raise PrototxtError(f"{where}loss_weight has {len(lp.loss_weight)} values but "
                                    f"the layer has {n} tops; give one per top")
            return list(lp.loss_weight)
        return [1.0 if (layer.is_loss and j == 0) else 0.0 for j in range(n)]

    def _append_params(self, layer, param_owner, where):
        """Register the layer's blobs with the solver, resolving `param { name }` sharing.
        Returns whether any of them is learned (so the layer needs backward)."""
        lp = layer.param
        learned = False
        layer.param_propagate_down = []
        for k, blob in enumerate(layer.blobs):
            spec = lp.param[k] if k < len(lp.param) else None
            lr_mult = spec.lr_mult if spec is not None else 1.0
            decay_mult = spec.decay_mult if spec is not None else 1.0
            name = spec.name if spec is not None else ""
            blob.name = f"{layer.name}[{k}]"
            learned = learned or lr_mult != 0
            layer.param_propagate_down.append(lr_mult != 0)
            if name and name in param_owner:
                owner = param_owner[name]
                permissive = spec.share_mode == spec.PERMISSIVE
                same = (owner.blob.count == blob.count) if permissive else \
                    (owner.blob.shape == blob.shape)
                if not same:
                    raise ShapeError(f"{where}shared param '{name}' has shape {blob.shape} here "
                                     f"but {owner.blob.shape} in layer '{owner.layer_name}'")
                if permissive and owner.blob.shape != blob.shape:
                    raise ShapeError(f"{where}shared param '{name}': PERMISSIVE sharing of "
                                     "differently shaped blobs is not supported")
                layer.blobs[k] = owner.blob
                continue
            info = ParamInfo(blob, layer.name, k, lr_mult, decay_mult, name,
                             layer.blob_parts.get(k))
            if name:
                param_owner[name] = info
            self.learnable_params.append(info)
        return learned

    def _mark_forms(self):
        """A blob that only layers taking forms touch may stay in a oneDNN form between them
        (blob.py); a blob any other layer touches is always read and written as an array, and
        so is every blob with SYNCSGD_FORMS=0."""
        taking = _taking_forms((layer.takes_forms, bottom + top) for layer, bottom, top in
                               zip(self.layers, self.bottom_vecs, self.top_vecs))
        for bottom, top in zip(self.bottom_vecs, self.top_vecs):
            for blob in bottom + top:
                blob.takes_forms = blob in taking

    def _mark_rewritten_tops(self):
        """Layer.tops_rewritten_later: a layer after it runs in place on one of its tops."""
        written = set()
        for layer, bottom, top in reversed(list(zip(self.layers, self.bottom_vecs,
                                                     self.top_vecs))):
            layer.tops_rewritten_later = any(id(t) in written for t in top)
            written.update(id(b) for b, t in zip(bottom, top) if b is t)

    def _in_place_blobs(self):
        """ids of the blobs some layer runs in place on."""
        return {id(t) for bottom, top in zip(self.bottom_vecs, self.top_vecs)
                for b, t in zip(bottom, top) if b is t}

    def _mark_kept_bottoms(self):
        """Layer.bottoms_kept: for each bottom, that no layer runs in place on it."""
        written = self._in_place_blobs()
        for layer, bottom in zip(self.layers, self.bottom_vecs):
            layer.bottoms_kept = [id(b) not in written for b in bottom]

    def _mark_read_only_tops(self):
        """Layer.tops_read_only: no layer runs in place on any of the layer's tops."""
        written = self._in_place_blobs()
        for layer, top in zip(self.layers, self.top_vecs):
            layer.tops_read_only = not any(id(t) in written for t in top)

    def _fuse(self):
        """{i: Fusion} for the layers i that do some of layer i + 1's work (Layer.absorb), as
        BatchNorm does a Scale's after it. Not where lanes may run either layer: they run their
        own copies of it, which the other one's fusion does not reach."""
        fusions = {}
        if not switches.fuse():
            return fusions
        run = self.lanes.run
        for i in range(len(self.layers) - 1):
            if run is not None and run[0] <= i + 1 and i <= run[1]:
                continue
            fusion = self.layers[i].absorb(self.layers[i + 1], self.bottom_vecs[i],
                                           self.top_vecs[i], self.bottom_vecs[i + 1],
                                           self.top_vecs[i + 1])
            if fusion is not None:
                fusions[i] = fusion
        return fusions

    def _prune_backward(self):
        """Caffe's Net::Init rules: no backward for a layer that does not lead to a loss, nor
        for one whose every top its consumers skip (propagate_down: false); force_backward
        then makes every layer compute every gradient it may, parameters' included."""
        under_loss, skipped = set(), set()
        for i in reversed(range(len(self.layers))):
            lp = self.layers[i].param
            tops = [blob.name for blob in self.top_vecs[i]]
            contributes = any(w != 0 for w in self.loss_weights[i]) or \
                any(name in under_loss for name in tops)
            if all(name in skipped for name in tops) or not contributes:
                self.layer_need_backward[i] = False
                self.bottom_need_backward[i] = [False] * len(lp.bottom)
            if contributes:
                under_loss.update(lp.bottom)
            skipped.update(name for name, need in zip(lp.bottom, self.bottom_need_backward[i])
                           if not need)
        if self.param.force_backward:
            for i, layer in enumerate(self.layers):
                self.layer_need_backward[i] = True
                self.bottom_need_backward[i] = [
                    need or layer.allow_force_backward(j)
                    for j, need in enumerate(self.bottom_need_backward[i])]
                layer.param_propagate_down = [True] * len(layer.blobs)

    # -- pycaffe API ------------------------------------------------------------------------
    @property
    def params(self):
        return OrderedDict((layer.name, layer.blobs) for layer in self.layers if layer.blobs)

    @property
    def layer_names(self):
        return [layer.name for layer in self.layers]

    _layer_names = layer_names

    @property
    def _blob_names(self):
        return list(self.blobs)

    @property
    def blob_loss_weights(self):
        """Every blob's loss weight (0 for blobs that are not losses), in net order."""
        return OrderedDict((name, self._loss_weight_of.get(name, 0.0)) for name in self.blobs)

    @property
    def top_names(self):
        return OrderedDict((layer.name, [b.name for b in top])
                           for layer, top in zip(self.layers, self.top_vecs))

    @property
    def bottom_names(self):
        return OrderedDict((layer.name, [b.name for b in bottom])
                           for layer, bottom in zip(self.layers, self.bottom_vecs))

    def _index(self, name, default):
        if name is None:
            return default
        if name not in self.layer_dict:
            raise KeyError(f"no layer named '{name}' in net '{self.name}'")
        return self.layer_names.index(name)

    def forward(self, blobs=None, start=None, end=None, **kwargs):
        """Run layers start..end (inclusive); kwargs give input blob values. Returns the outputs
        (the tops of `end` when given) and the blobs named in `blobs`."""
        for name, value in kwargs.items():
            if name not in self.blobs:
                raise KeyError(f"'{name}' is not a blob of net '{self.name}'; inputs are "
                               f"{self.inputs}")
            blob = self.blobs[name]
            value = np.asarray(value, np.float32)
            if value.shape != blob.shape:
                raise ShapeError(f"input '{name}' has shape {value.shape} but the blob has "
                                 f"{blob.shape}; call net.blobs['{name}'].reshape(...) and "
                                 "net.reshape() first")
            blob.data[...] = value
        first = self._index(start, 0)
        last = self._index(end, len(self.layers) - 1)
        self._forward(first, last)
        names = list(self.outputs) if end is None else [b.name for b in self.top_vecs[last]]
        names += [b for b in (blobs or []) if b not in names]
        return OrderedDict((name, self.blobs[name].data) for name in names)

    def _forward(self, first, last, then_backward=False):
        """Layers first..last forward. With then_backward, lanes whose run ends at `last` carry
        their rows back through the run in the same hand-off of the threads (seeding the loss
        diffs first). Returns the lowest layer whose backward has run (last + 1: none)."""
        self.loss = 0.0
        for i, fusion in self._fusions.items():      # both layers run, or neither fuses
            fusion.forward = first <= i and i + 1 <= last
        i = first
        while i <= last:
            lanes = self.lanes.forward_at(i)
            if lanes is None:
                self.forward_layer(i)
                i += 1
                continue
            hi = min(last, lanes.last)
            for j in range(i, hi + 1):
                for hook in self.forward_hooks:
                    hook(j)
            began = time.perf_counter()
            fused = then_backward and hi == last
            if fused:
                self.seed_loss_diffs()
                lanes.forward_backward(i, hi)
                self._lane_span("forward and backward", i, hi, began)
            else:
                lanes.forward(i, hi)
                self._lane_span("forward", i, hi, began)
            for j in range(i, hi + 1):
                self._add_loss(j)
            if fused:
                for j in range(hi, i - 1, -1):
                    self._settle_params(j)
                    for hook in self.backward_hooks:
                        hook(j)
                return i
            i = hi + 1
        return last + 1

    def forward_all(self, blobs=None, **kwargs):
        """forward() over inputs of any number of samples, a batch at a time (the last padded
        with zeros); outputs (and `blobs`) concatenated, the padding dropped."""
        outs = OrderedDict()
        for batch in self._batches(kwargs):
            for name, value in self.forward(blobs=blobs, **batch).items():
                outs.setdefault(name, []).append(value.copy())
        return self._joined(outs, kwargs)

    def forward_backward_all(self, blobs=None, diffs=None, **kwargs):
        """forward_all and backward over the same batches: kwargs name inputs (data) and outputs
        (their diffs); (outputs, input diffs) concatenated."""
        inputs = {k: v for k, v in kwargs.items() if k not in self.outputs}
        top_diffs = {k: v for k, v in kwargs.items() if k in self.outputs}
        outs, grads = OrderedDict(), OrderedDict()
        for fb, bb in zip_longest(self._batches(inputs), self._batches(top_diffs), fillvalue={}):
            for name, value in self.forward(blobs=blobs, **fb).items():
                outs.setdefault(name, []).append(value.copy())
            for name, value in self.backward(diffs=diffs, **bb).items():
                grads.setdefault(name, []).append(value.copy())
        samples = inputs or top_diffs
        return self._joined(outs, samples), self._joined(grads, samples)

    def _batches(self, arrays):
        """pycaffe's Net._batch: {name: (batch, ...)} slices of `arrays`, the last zero-padded."""
        if not arrays:
            yield {}
            return
        num = len(next(iter(arrays.values())))
        batch_size = next(iter(self.blobs.values())).shape[0]
        for i in range(0, num, batch_size):
            batch = {}
            for name, values in arrays.items():
                part = np.asarray(values[i:i + batch_size], np.float32)
                if len(part) < batch_size:
                    padding = np.zeros((batch_size - len(part),) + part.shape[1:], np.float32)
                    part = np.concatenate([part, padding])
                batch[name] = part
            yield batch

    @staticmethod
    def _joined(pieces, given):
        """Batches of each output joined along the sample axis, the padding cut off."""
        num = len(next(iter(given.values()))) if given else None
        return OrderedDict((name, np.concatenate(parts)[:num]) for name, parts in pieces.items())

    def forward_layer(self, i):
        self.lanes.serial(i)
        for hook in self.forward_hooks:
            hook(i)
        layer, bottom, top = self.layers[i], self.bottom_vecs[i], self.top_vecs[i]
        start = time.perf_counter() if self.timeline is not None else 0.0
        layer.reshape(bottom, top)
        layer.forward(bottom, top)
        if self.timeline is not None:
            self.timeline.span(f"{layer.name} forward", "forward", start, time.perf_counter())
        self._add_loss(i)
        if self.debug_info:
            for blob in top:
                log.info(f"    [Forward] Layer {layer.name}, top blob {blob.name} data: "
                         f"{log.fmt(_mean_abs(blob.data))}")
            for k, blob in enumerate(layer.blobs):
                log.info(f"    [Forward] Layer {layer.name}, param blob {k} data: "
                         f"{log.fmt(_mean_abs(blob.data))}")

    def _add_loss(self, i):
        """Layer i's loss-weighted tops into self.loss."""
        for j, weight in enumerate(self.loss_weights[i]):
            if weight:
                self.loss += weight * float(self.top_vecs[i][j].data.sum(dtype=np.float64))

    def backward(self, diffs=None, start=None, end=None, **kwargs):
        """Back-propagate from layer `start` (default the last) down to `end` (default the first);
        kwargs give output blob diffs. Returns the diffs of the bottoms of `end` (the inputs when
        not given) and of the blobs named in `diffs`."""
        for name, value in kwargs.items():
            if name not in self.blobs:
                raise KeyError(f"'{name}' is not a blob of net '{self.name}'")
        top = self._index(start, len(self.layers) - 1)
        bottom = self._index(end, 0)
        names = self.inputs if end is None else [b.name for b in self.bottom_vecs[bottom]]
        self.seed_loss_diffs()
        for name, value in kwargs.items():
            self.blobs[name].diff[...] = value
        self._backward(top, bottom)
        names = list(names) + [d for d in (diffs or []) if d not in names]
        return OrderedDict((name, self.blobs[name].diff) for name in names)

    def _backward(self, top, bottom):
        for i, fusion in self._fusions.items():
            fusion.backward = (bottom <= i and i + 1 <= top and self.layer_need_backward[i]
                               and self.layer_need_backward[i + 1]
                               and all(self.bottom_need_backward[i]))
        i = top
        while i >= bottom:
            lanes = self.lanes.backward_at(i)
            if lanes is None:
                self.backward_layer(i)
                i -= 1
                continue
            lo = max(bottom, lanes.first)
            began = time.perf_counter()
            lanes.backward(lo, i)
            self._lane_span("backward", lo, i, began)
            for j in range(i, lo - 1, -1):
                self._settle_params(j)
                for hook in self.backward_hooks:
                    hook(j)
            i = lo - 1

    def _lane_span(self, what, lo, hi, start):
        """One timeline span for layers lo..hi run in lanes (their per-layer times overlap)."""
        if self.timeline is not None:
            names = f"{self.layers[lo].name}..{self.layers[hi].name}"
            self.timeline.span(f"{names} {what} (lanes)", what, start, time.perf_counter())

    def seed_loss_diffs(self):
        """Backward starts from d(loss)/d(top) = loss_weight for every loss-weighted top."""
        for i, weights in enumerate(self.loss_weights):
            for j, weight in enumerate(weights):
                if weight:
                    self.top_vecs[i][j].diff[...] = weight

    def backward_layer(self, i):
        if self.layer_need_backward[i]:
            start = time.perf_counter() if self.timeline is not None else 0.0
            self.layers[i].backward(self.top_vecs[i], self.bottom_need_backward[i],
                                    self.bottom_vecs[i])
            if self.timeline is not None:
                self.timeline.span(f"{self.layers[i].name} backward", "backward", start,
                                   time.perf_counter())
            if self.debug_info:
                self._backward_debug(i)
        self._settle_params(i)
        for hook in self.backward_hooks:
            hook(i)

    def _settle_params(self, i):
        """Layer i's parameter diffs that the solver's step cleared and its backward did not
        write (lr_mult 0, or no backward) become zeros in their arrays before anything reads
        them: the distributed reducer sends the arrays as they are."""
        for blob in self.layers[i].blobs:
            if blob.cleared:
                blob.sync(1)

    def _backward_debug(self, i):
        layer = self.layers[i]
        for blob, need in zip(self.bottom_vecs[i], self.bottom_need_backward[i]):
            if need:
                log.info(f"    [Backward] Layer {layer.name}, bottom blob {blob.name} diff: "
                         f"{log.fmt(_mean_abs(blob.diff))}")
        for k, blob in enumerate(layer.blobs):
            log.info(f"    [Backward] Layer {layer.name}, param blob {k} diff: "
                     f"{log.fmt(_mean_abs(blob.diff))}")

    def update_debug_info(self):
        for info in self.learnable_params:
            log.info(f"    [Update] Layer {info.layer_name}, param {info.index} data: "
                     f"{log.fmt(_mean_abs(info.blob.data))}; diff: "
                     f"{log.fmt(_mean_abs(info.blob.diff))}")

    def forward_backward(self, clear=False):
        """forward() then backward(); lanes reaching the last layer go forward and back in one
        hand-off of the threads. Returns the loss.

        With `clear` (the solver's step, with no user code between its clearing and the pass)
        the parameter gradients start from zero without a pass that zeroes them: each diff is
        cleared lazily (Blob.clear_diff), the first kernel to write it writes over it, and
        every diff holds its values in its array again by the time this returns."""
        if clear:
            for info in self.learnable_params:
                info.blob.clear_diff()
        try:
            last = len(self.layers) - 1
            done = self._forward(0, last, then_backward=True)
            if done > last:
                self.seed_loss_diffs()
            self._backward(done - 1, 0)
        finally:
            if clear:
                for info in self.learnable_params:
                    if info.blob.cleared:
                        info.blob.sync(1)
        return self.loss

    def reshape(self):
        for layer, bottom, top in zip(self.layers, self.bottom_vecs, self.top_vecs):
            self._reshape_layer(layer, bottom, top)

    @staticmethod
    def _reshape_layer(layer, bottom, top):
        """layer.reshape, then its tops' Blob.gets_forms, for the layers after it that time
        their kernels in their reshape."""
        layer.reshape(bottom, top)
        leaves = layer.leaves_forms(bottom)
        for blob in top:
            blob.gets_forms = blob.takes_forms and leaves

    def clear_param_diffs(self):
        """Zero the parameter gradients (pycaffe's: the arrays a user holds read zeros). The
        solver's step clears them lazily instead, inside forward_backward(clear=True)."""
        for info in self.learnable_params:
            info.blob.zero_diff()

    def copy_from(self, path):
        from syncsgd.weights import copy_from
        copy_from(self, path)

    def save(self, path, write_diff=False):
        from syncsgd.weights import save
        save(self, path, write_diff)

    def save_hdf5(self, path, write_diff=False):
        """Caffe's HDF5 layout whatever the file's name (pycaffe's Net.save_hdf5)."""
        from syncsgd.weights import save
        save(self, path, write_diff, hdf5=True)

    def load_hdf5(self, path):
        """pycaffe's Net.load_hdf5: copy_from, which recognises HDF5 by its content."""
        self.copy_from(path)

    def share_with(self, other):
        """Use `other`'s parameter blobs (a test net sharing the train net's weights)."""
        for layer in self.layers:
            source = other.layer_dict.get(layer.name)
            if source is None or not layer.blobs:
                continue
            mine, theirs = [b.shape for b in layer.blobs], [b.shape for b in source.blobs]
            if mine != theirs:
                raise ShapeError(f"layer '{layer.name}' ({layer.type}): parameter shapes "
                                 f"differ between the {_PHASES[other.phase]} net ({other.source}"
                                 f", {theirs}) and the {_PHASES[self.phase]} net ({self.source},"
                                 f" {mine}); the layer shares its weights by name, so make it "
                                 "the same in both (or rename it in one)")
            layer.blobs[:] = source.blobs

    def close(self):
        """Stop background work (data prefetch threads) of every layer."""
        for layer in self.layers:
            close = getattr(layer, "close", None)
            if close is not None:
                close()

    def set_input_arrays(self, data, labels):
        """pycaffe's: hand arrays to the MemoryData layer that must come first in the net."""
        if not self.layers or self.layers[0].type != "MemoryData":
            raise PrototxtError(f"net '{self.name}': set_input_arrays may only be called if the "
                                "first layer is a MemoryData layer")
        self.layers[0].set_input_arrays(data, labels)


def _param_text(param):
    """The NetParameter as Caffe logs it, less weights written inside the prototxt (`blobs`),
    which can be millions of numbers."""
    if any(lp.blobs for lp in param.layer):
        shown = type(param)()
        shown.CopyFrom(param)
        for lp in shown.layer:
            del lp.blobs[:]
        param = shown
    return text_format.MessageToString(param)


def _taking_forms(touches):
    """Of the blobs (or their names) in `touches`, (whether a layer takes forms, the blobs it
    touches) for each layer, those that only layers taking forms touch; none with
    SYNCSGD_FORMS=0."""
    takes, forms = {}, switches.forms()
    for ok, blobs in touches:
        for blob in blobs:
            takes[blob] = takes.get(blob, forms) and ok
    return {blob for blob, ok in takes.items() if ok}


def _log_setup(name, top, weights):
    """Caffe's "Setting up" lines of a layer; returns the bytes of its tops (float32)."""
    log.info(f"Setting up {name}")
    count = 0
    for blob, weight in zip(top, weights):
        log.info(f"Top shape: {''.join(f'{d} ' for d in blob.shape)}({blob.count})")
        if weight:
            log.info(f"    with loss weight {log.fmt(weight)}")
        count += blob.count
    return count * 4


def _mean_abs(array):
    return float(np.abs(array).mean()) if array.size else 0.0
