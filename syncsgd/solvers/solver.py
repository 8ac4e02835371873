"""The training loop every solver type shares, in Caffe's order (Solver::Step, Solver::Solve).

An update rule only implements `compute_update(grad, histories, local_rate)`; gradient.py walks
each parameter in cache-sized blocks, computing the iter_size-scaled, clipped, regularised
gradient of a block just before the rule updates its histories and applies the step. The solver
sees parameters through `net.learnable_params` (blob, lr_mult, decay_mult), never layer types.
Whatever crosses ranks (seed, gradients, sharded updates, whole state for snapshots) goes through
one synchronisation object, `self.sync` (syncsgd.parallel), called at fixed points of the loop;
on one process it does nothing.
"""
import math
import os
import re
import signal
import time
from collections import deque

import numpy as np
from google.protobuf import text_format

from syncsgd import TEST, TRAIN, log
from syncsgd.compile import load_message
from syncsgd.context import random_seed
from syncsgd.errors import NumericalError, PrototxtError, SnapshotError, WeightsError
from syncsgd.kernels.blas import all_finite
from syncsgd.net import Net
from syncsgd.parallel import default_sync
from syncsgd.progress import progress
from syncsgd.proto import pb
from syncsgd.solvers.gradient import Gradient
from syncsgd.solvers.lock import PrefixLock
from syncsgd.solvers.lr_policy import learning_rate
from syncsgd.solvers.snapshot import State, read_state, write_state
from syncsgd.weights import (copy_from, file_sha256, full_shape, save, shapes_fit, take_part,
                             verify_checksum)


class Solver:
    type = None
    history_sets = 1     # AdaDelta and Adam keep two histories per parameter

    def __init__(self, solver, sync=None):
        """`solver`: a solver prototxt path or SolverParameter. `sync`: what crosses ranks;
        by default syncsgd.parallel.default_sync(), all ranks of an MPI launch or one process."""
        self.param, self.source = load_solver_param(solver)
        if log.enabled():
            log.info("Initializing solver from parameters: \n" +
                     text_format.MessageToString(self.param))
        self.sync = sync or default_sync()
        self.rank = self.sync.rank
        self.prefix_lock = PrefixLock(self.param.snapshot_prefix)
        if self.param.snapshot or self.param.snapshot_after_train:
            # Caffe's start-up check that snapshots can be written, and that no other run
            # writes the same files; a run that plans none takes the prefix at its first.
            self.sync.root_check(self.prefix_lock.acquire)
        try:
            self._build()
        except BaseException:
            self.prefix_lock.release()
            raise

    def _build(self):
        """The nets, the histories and the loop's state."""
        seed = self.param.random_seed
        if seed < 0:
            seed = random_seed()
            seed = self.sync.agree_seed(int.from_bytes(os.urandom(4), "little")
                                        if seed is None else seed)
        self.seed = seed
        self.ctx = self.sync.context(TRAIN, seed)
        self.net = Net(self._train_net_param(), TRAIN, ctx=self.ctx,
                       transform=self.sync.net_transform(self.ctx),
                       **self._state_args(self.param.train_state
                                          if self.param.HasField("train_state") else None))
        self.test_nets = []
        for i, ((net_param, state), origin) in enumerate(zip(self._test_net_params(),
                                                             self._test_net_origins())):
            log.info(f"Creating test net (#{i}) specified by {origin}")
            ctx = self.sync.context(TEST, seed)
            net = Net(net_param, TEST, ctx=ctx, transform=self.sync.net_transform(ctx),
                      **self._state_args(state))
            net.share_with(self.net)
            self.test_nets.append(net)
        self.iter = 0
        self.current_step = 0
        self.history = [np.zeros_like(p.blob.data)
                        for _ in range(self.history_sets) for p in self.net.learnable_params]
        self.losses = deque(maxlen=max(1, self.param.average_loss))
        self.smoothed_loss = 0.0
        self.requested = None
        self.sync.attach(self.net, self.param)
        self.tests_run = 0
        self.signal_effects = {"SIGINT": "stop", "SIGHUP": "snapshot", "SIGTERM": "snapshot"}
        self.terminated = False     # SIGTERM reached the job: training ends at the boundary
        self.timeline = None
        self.callbacks = []         # (on_start, on_gradients_ready) pairs, as Caffe's
        self.last_snapshot = None
        self.failed_snapshot = None     # (iteration, path, reason) of the last failed snapshot
        # Caffe leaves each update's step in the parameters' diffs. Only snapshot_diff and
        # debug_info read it, so by default the step goes straight into the weights (one pass
        # fewer); set keep_step to have it always, e.g. to inspect diffs after step().
        self.keep_step = False
        self.display_clock = None   # (time, iteration) of the last display line
        log.info("Solver scaffolding done.")
        log.info(self._ranks_line())

    # -- construction helpers ---------------------------------------------------------------
    def _resolve(self, path):
        """Caffe reads net paths relative to the working directory; fall back to the solver's."""
        if os.path.exists(path) or self.source.startswith("<"):
            return path
        beside = os.path.join(os.path.dirname(self.source), path)
        return beside if os.path.exists(beside) else path

    def _train_net_param(self):
        p = self.param
        given = [f for f in ("train_net_param", "train_net", "net_param", "net") if p.HasField(f)]
        if len(given) != 1:
            raise PrototxtError(f"{self.source}: give exactly one of train_net_param, train_net, "
                                f"net_param or net (found {given or 'none'})")
        field = given[0]
        if field.endswith("_param"):
            log.info(f"Creating training net specified in {field}.")
            return getattr(p, field)
        log.info(f"Creating training net from {field} file: {getattr(p, field)}")
        return self._resolve(getattr(p, field))

    def _test_net_params(self):
        p = self.param
        nets = list(p.test_net_param) + [self._resolve(f) for f in p.test_net]
        generic = p.net_param if p.HasField("net_param") else (
            self._resolve(p.net) if p.HasField("net") else None)
        if generic is not None:
            nets += [generic] * max(0, len(p.test_iter) - len(nets))
        if len(p.test_iter) != len(nets):
            raise PrototxtError(f"{self.source}: {len(nets)} test net(s) but {len(p.test_iter)} "
                                "test_iter value(s); give one test_iter per test net")
        if p.test_state and len(p.test_state) != len(nets):
            raise PrototxtError(f"{self.source}: test_state must be given once per test net")
        states = list(p.test_state) or [None] * len(nets)
        return list(zip(nets, states))

    def _test_net_origins(self):
        """Where each test net of _test_net_params comes from, in Caffe's words."""
        p = self.param
        origins = ["test_net_param"] * len(p.test_net_param) + \
            [f"test_net file: {f}" for f in p.test_net]
        generic = "net_param" if p.HasField("net_param") else f"net file: {p.net}"
        return origins + [generic] * max(0, len(p.test_iter) - len(origins))

    def _ranks_line(self):
        """syncsgd's start-up line: how many ranks train, and on several the parallel mode of
        each fully connected layer (docs/method.md, "Model and hybrid parallelism")."""
        size = self.sync.size
        if size == 1:
            return "Training on 1 rank"
        modes = []
        for lp in self.net.param.layer:
            if lp.HasField("inner_product_param"):     # also once split over ranks
                pp = lp.parallel_param
                mode = pb.ParallelParameter.Mode.Name(pp.mode)
                modes.append(f"{lp.name}: {mode}" +
                             (f" (groups: {pp.groups})" if pp.mode == pp.HYBRID else ""))
        return f"Training on {size} ranks" + (f"; fully connected layers {', '.join(modes)}"
                                              if modes else "")

    @staticmethod
    def _state_args(state):
        if state is None:
            return {}
        return {"level": state.level, "stages": list(state.stage)}

    # -- the loop ---------------------------------------------------------------------------
    def solve(self, resume_file=None):
        with _SignalActions(self):      # also through the last snapshot and test pass
            self._solve(resume_file)
        self._end_if_terminated()

    def _solve(self, resume_file):
        log.info(f"Solving {self.net.name}")
        log.info(f"Learning Rate Policy: {self.param.lr_policy}")
        if resume_file:
            log.info(f"Restoring previous solver status from {resume_file}")
            self.restore(resume_file)
            self.display_clock = None
        self.step(self.param.max_iter - self.iter)
        p = self.param
        if p.snapshot_after_train and (not p.snapshot or self.iter % p.snapshot != 0):
            self.snapshot()
        self.sync.root_check(self._check_saved)
        if self.requested == "stop":
            log.info("Optimization stopped early.")
            return
        if p.display and self.iter % p.display == 0:
            self.ctx.iteration = self.iter * p.iter_size
            self.net.forward()
            self._update_smoothed_loss(self.net.loss)
            log.info(f"Iteration {self.iter}, loss = {log.fmt(self.smoothed_loss)}")
        if p.test_interval and self.iter % p.test_interval == 0:
            self.test_all()
        log.info("Optimization Done.")

    def step(self, iterations):
        p = self.param
        stop = self.iter + iterations
        self.losses.clear()
        if self.display_clock is None:
            self.display_clock = (time.perf_counter(), self.iter)
        self.requested = None
        self.terminated = False
        with _SignalActions(self), progress(iterations, self.rank == 0) as bar:
            while self.iter < stop:
                # Caffe clears the gradients here, before on_start; without callbacks no user
                # code runs before the pass, which then clears them lazily (forward_backward).
                if self.callbacks:
                    self.net.clear_param_diffs()
                if p.test_interval and self.iter % p.test_interval == 0 and \
                        (self.iter > 0 or p.test_initialization):
                    self.sync.flush()
                    self.test_all()
                    if self.requested == "stop":
                        break
                for on_start, _ in self.callbacks:
                    on_start()
                display = p.display and self.iter % p.display == 0
                self.net.debug_info = bool(display and p.debug_info)
                loss = 0.0
                for k in range(p.iter_size):
                    self.ctx.iteration = self.iter * p.iter_size + k
                    self.sync.begin_pass(last=k == p.iter_size - 1)
                    loss += self.net.forward_backward(clear=k == 0 and not self.callbacks)
                loss /= p.iter_size
                self._update_smoothed_loss(loss)
                if display:
                    log.info(f"Iteration {self.iter} {self._speed()}, loss = "
                             f"{log.fmt(self.smoothed_loss)}")
                    self._log_outputs(self.net, "Train", [
                        self.net.blobs[name].data for name in self.net.outputs])
                self.sync.gradients_ready()
                for _, on_gradients_ready in self.callbacks:
                    on_gradients_ready()
                self._check_finite(loss)
                start = time.perf_counter()
                self.apply_update(display)
                if self.net.debug_info:
                    self.net.update_debug_info()
                if self.timeline is not None:
                    self.timeline.span("update", "update", start, time.perf_counter())
                # Caffe's iteration boundary: a signal on any rank acts here on every rank.
                actions = self.sync.agreed_requests(TRAIN, self.iter)
                self.iter += 1
                bar.update(1)
                self._take(actions)
                # A stop is snapshotted after the loop (snapshot_after_train); training that
                # ends (SIGTERM) never gets there, so the snapshot it asks for is taken here.
                if (p.snapshot and self.iter % p.snapshot == 0) or ("snapshot" in actions and (
                        self.requested != "stop" or self.terminated)):
                    self.snapshot()
                if self.requested == "stop":
                    break
        self.sync.flush()
        self._end_if_terminated()

    def _take(self, actions):
        """Note what agreed requests ask besides a snapshot: to stop, or to end (SIGTERM)."""
        if "stop" in actions or "terminate" in actions:
            self.requested = "stop"
        if "terminate" in actions:
            self.terminated = True

    def _end_if_terminated(self):
        if self.terminated:
            raise Terminated(self.iter, self.last_snapshot if self.rank == 0 else None)

    def add_callback(self, on_start, on_gradients_ready):
        """pycaffe's Solver.add_callback: call on_start() as each iteration begins and
        on_gradients_ready() when the (global) gradients are complete, before the update."""
        self.callbacks.append((on_start, on_gradients_ready))

    def share_weights(self, net):
        """pycaffe's Solver.share_weights: `net` uses this solver's train net weights."""
        net.share_with(self.net)

    def enable_timeline(self, path):
        """Record a Chrome trace of this run, written to `path` by close()."""
        self.timeline = self.sync.start_timeline()
        self.timeline_path = path
        self.net.timeline = self.timeline

    def close(self):
        """Write the timeline, stop the communication thread and the data prefetchers."""
        self.sync.flush()
        if self.timeline is not None:
            self.sync.write_timeline(self.timeline, self.timeline_path)
        self.sync.close()
        for net in [self.net] + self.test_nets:
            net.close()
        self.prefix_lock.release()

    def _check_finite(self, loss):
        """Stop before a NaN or infinity reaches the weights, naming where it came from (one
        memory-bound pass over each gradient: kernels.blas.all_finite)."""
        params = self.net.learnable_params
        if np.isfinite(loss) and all(all_finite(p.blob.diff) for p in params):
            return
        where = _first_non_finite(self.net)
        # Only rank 0 writes snapshots, and only it knows whether the last one succeeded.
        last = f"the last snapshot is {self.last_snapshot or 'none was written'}" \
            if self.rank == 0 else "rank 0's log names the last snapshot"
        raise NumericalError(
            f"iteration {self.iter}: {where}. Training stopped before the update, so no weight "
            f"was changed; {last}. Lower base_lr, set clip_gradients, or check the data.")

    def _update_smoothed_loss(self, loss):
        """Caffe's smoothed loss: the mean of the last average_loss losses, by math.fsum (exact,
        and a tenth of np.mean's time on a deque: docs/performance.md, "Lanes: what a pass
        costs besides its layers")."""
        self.losses.append(loss)
        self.smoothed_loss = math.fsum(self.losses) / len(self.losses)

    def _speed(self):
        """Caffe's "(N iter/s, Ts/D iters)": the iterations and seconds since the last display
        line (or since training started), which include test passes, as Caffe counts them."""
        now = time.perf_counter()
        then, iteration = self.display_clock
        self.display_clock = (now, self.iter)
        lapse = now - then
        per_s = (self.iter - iteration) / (lapse or 1)
        return f"({log.fmt(per_s)} iter/s, {log.fmt(lapse)}s/{self.param.display} iters)"

    def _log_outputs(self, net, kind, values):
        index = 0
        weights = net.blob_loss_weights
        for name, value in zip(net.outputs, values):
            weight = weights[name]
            for v in np.asarray(value).reshape(-1):
                extra = f" (* {log.fmt(weight)} = {log.fmt(weight * v)} loss)" if weight else ""
                log.info(f"    {kind} net output #{index}: {name} = {log.fmt(v)}{extra}")
                index += 1

    # -- the update -------------------------------------------------------------------------
    def learning_rate(self):
        return learning_rate(self.param, self.iter, self)

    def apply_update(self, display=False):
        rate = self.learning_rate()
        if display:
            log.info(f"Iteration {self.iter}, lr = {log.fmt(rate)}")
        params = self.net.learnable_params
        segments = self.sync.owned_segments()
        # Caffe clips the accumulated gradient, then divides it by iter_size: one factor here,
        # applied as each block's gradient is computed.
        scale = np.float32(self.clip_factor(segments)) * np.float32(1.0 / self.param.iter_size)
        keep_step = self.keep_step or self.param.snapshot_diff or self.net.debug_info
        n = len(params)
        for i, part in segments:
            info = params[i]
            decay = self.param.weight_decay * info.decay_mult
            grad = Gradient(info.blob.diff.reshape(-1)[part], info.blob.data.reshape(-1)[part],
                            scale, decay, self.param.regularization_type, keep_step, self.source)
            histories = [self.history[i + k * n].reshape(-1)[part]
                         for k in range(self.history_sets)]
            self.compute_update(grad, histories, rate * info.lr_mult)
        self.sync.after_update()

    def clip_factor(self, segments):
        """Caffe's clip_gradients: the factor (1 if none) that brings the global gradient's L2
        norm down to clip_gradients. The update applies it; the diffs are not rescaled here."""
        clip = self.param.clip_gradients
        if clip < 0:
            return 1.0
        norm = float(np.sqrt(self.sync.global_sumsq(segments)))
        if norm <= clip:
            return 1.0
        scale = np.float32(clip / norm)
        log.info(f"Gradient clipping: scaling down gradients (L2 norm {log.fmt(norm)} > "
                 f"{log.fmt(clip)}) by scale factor {log.fmt(scale)}")
        return scale

    def compute_update(self, grad, histories, local_rate):
        """Update `histories` (flat slices) from the gradient and apply the step to the weights:
        `grad.apply(rule, histories)` with the rule as a function of one block (see gradient.py)."""
        raise NotImplementedError

    # -- testing ----------------------------------------------------------------------------
    def test_all(self):
        for i in range(len(self.test_nets)):
            self.test(i)
        self.tests_run += 1

    def test(self, index):
        log.info(f"Iteration {self.iter}, Testing net (#{index})")
        net = self.test_nets[index]
        iterations = self.param.test_iter[index]
        scores = None
        loss = 0.0
        for _ in range(iterations):
            if self.requested != "stop":
                actions = self.sync.agreed_requests(TEST, self.iter)
                if "snapshot" in actions:
                    self.snapshot()
                self._take(actions)
            if self.requested == "stop":
                log.info("Test interrupted.")
                return {}
            net.forward()
            if self.param.test_compute_loss:
                loss += net.loss
            values = [net.blobs[name].data.astype(np.float64).ravel() for name in net.outputs]
            scores = values if scores is None else [s + v for s, v in zip(scores, values)]
        if self.param.test_compute_loss:
            log.info(f"Test loss: {log.fmt(loss / iterations)}")
        means = [s / iterations for s in scores or []]
        self._log_outputs(net, "Test", means)
        return dict(zip(net.outputs, means))

    # -- snapshots --------------------------------------------------------------------------
    def snapshot_filename(self, extension):
        return f"{self.param.snapshot_prefix}_iter_{self.iter}{extension}"

    def snapshot(self):
        """Weights and solver state under snapshot_prefix; every rank calls it, rank 0 writes.
        Files always hold whole parameters, whatever the layout of the run."""
        self.sync.flush()
        full = self.sync.whole_params()
        history = self.sync.whole_history(self.history)
        if self.rank != 0:
            return None
        h5 = self.param.snapshot_format == pb.SolverParameter.HDF5
        model = self.snapshot_filename(".caffemodel.h5" if h5 else ".caffemodel")
        state = self.snapshot_filename(".solverstate.h5" if h5 else ".solverstate")
        kind = "HDF5 file" if h5 else "binary proto file"
        target = model
        try:
            self.prefix_lock.acquire()
            directory = os.path.dirname(model)
            if directory:
                os.makedirs(directory, exist_ok=True)
            log.info(f"Snapshotting to {kind} {model}")
            digest = save(self.net, model, self.param.snapshot_diff, full, checksum=True)
            target = state
            log.info(f"Snapshotting solver state to {kind} {state}")
            write_state(state, State(self.iter, model, self.current_step, history, digest),
                        checksum=True)
        except (OSError, SnapshotError, WeightsError) as e:
            # A full disk (or a binary file beyond protobuf's size) must not end a long run or
            # damage what is there: the files are written whole or not at all, and training goes
            # on.
            reason = (e.strerror or str(e)) if isinstance(e, OSError) else str(e)
            self.failed_snapshot = (self.iter, target, reason)
            log.error(f"Snapshot at iteration {self.iter} failed: {reason}. Training "
                      f"continues; the last good snapshot is {self.last_snapshot or 'none'}.")
            return None
        self.last_snapshot = state
        return model, state

    def _check_saved(self):
        """A run that could save none of its snapshots must not end as if it had succeeded
        (Caffe would print "Optimization Done."): the trained weights exist only in memory."""
        if self.failed_snapshot is None or self.last_snapshot is not None:
            return
        iteration, path, reason = self.failed_snapshot
        raise SnapshotError(f"every snapshot of this run failed, the last at iteration "
                            f"{iteration} ({path}: {reason}); nothing was saved. Fix the cause "
                            "there (space, permissions) or set snapshot_prefix elsewhere")

    def restore(self, path):
        state, weights = read_checked_state(path)
        if len(state.history) != len(self.history):
            raise WeightsError(f"{path}: {len(state.history)} history blobs, but a {self.type} "
                               f"solver on this net keeps {len(self.history)}; is it the state "
                               "of another net or solver type?")
        params = self.net.learnable_params
        parts = [params[i % len(params)].part for i in range(len(self.history))]
        for i, stored in enumerate(state.history):
            expected = full_shape(self.history[i].shape, parts[i])
            if not shapes_fit(stored.shape, expected, stored.legacy) or \
                    stored.count != np.prod(expected, dtype=np.int64):
                raise WeightsError(f"{path}: history blob {i} has shape {stored.shape}, the "
                                   f"net's parameter has {expected}")
        if weights:
            copy_from(self.net, weights, complete=True)
        for i, (target, stored) in enumerate(zip(self.history, state.history)):
            if parts[i] is None:
                stored.read_into(target.reshape(-1))      # one history blob at a time
            else:
                values = stored.values().reshape(full_shape(target.shape, parts[i]))
                target[...] = take_part(values, parts[i])
        self.iter = state.iter
        self.current_step = state.current_step
        self._restore_data_positions()

    def newest_snapshot(self):
        """The newest intact solver state under snapshot_prefix, or None: what a requeued job
        resumes from. Rank 0 looks; every rank gets its answer."""
        return self.sync.from_root(lambda: newest_state(self.param.snapshot_prefix))

    def _restore_data_positions(self):
        """Data layers continue where an uninterrupted run would be: the train net has read
        iter * iter_size batches, each test net test_iter batches per test pass so far."""
        p = self.param
        _seek(self.net, self.iter * p.iter_size)
        tests = 0
        if p.test_interval:
            tests = -(-self.iter // p.test_interval) - (0 if p.test_initialization else 1)
            tests = max(tests, 0)
        self.tests_run = tests
        for net, iterations in zip(self.test_nets, p.test_iter):
            _seek(net, tests * iterations)


def read_checked_state(path):
    """A solver state and the path of its weights ("" if it names none), each file intact and
    the weights the very file written with the state; WeightsError otherwise."""
    verify_checksum(path)
    state = read_state(path)
    if not state.learned_net:
        return state, ""
    weights = _learned_net_path(path, state.learned_net)
    _check_pair(path, weights, state.learned_net_sha256)
    return state, weights


def newest_state(prefix):
    """The state `<prefix>_iter_<N>.solverstate[.h5]` of the highest N that reads whole with its
    weights (read_checked_state), or None. Snapshots are renamed into place only once written
    (weights.atomic_write), so a run killed while writing one leaves only a hidden temporary
    file; a state cut short or changed since is skipped, saying why."""
    directory = os.path.dirname(prefix) or "."
    pattern = re.compile(re.escape(os.path.basename(prefix)) + r"_iter_(\d+)\.solverstate(\.h5)?")
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return None
    found = sorted(((int(m.group(1)), name) for name in names
                    if (m := pattern.fullmatch(name))), reverse=True)
    for _, name in found:
        path = os.path.join(directory, name)
        try:
            read_checked_state(path)
        except WeightsError as e:
            log.error(f"Not resuming from {path}: {e}")
            continue
        return path
    return None


def _learned_net_path(state_path, learned):
    """The weights a state names: as written, else beside the state file (moved runs)."""
    if os.path.exists(learned):
        return learned
    beside = os.path.join(os.path.dirname(state_path), os.path.basename(learned))
    if os.path.exists(beside):
        return beside
    raise WeightsError(f"{state_path}: names weights '{learned}', which exist neither there "
                       f"nor beside the state file")


def _check_pair(state_path, weights, digest):
    """The weights must be intact (their own record) and the very file written with the state:
    two runs on one prefix could otherwise pair one run's weights with the other's state, each
    file intact on its own."""
    verify_checksum(weights)
    if not digest:
        log.info(f"{state_path} records no digest of its weights (a state of Caffe or of an "
                 f"older syncsgd): {weights} is not checked against it")
        return
    actual = file_sha256(weights)
    if actual != digest:
        raise WeightsError(f"{state_path} was saved with weights of SHA-256 {digest[:16]}..., "
                           f"but {weights} has {actual[:16]}...: the two files come from "
                           "different runs or snapshots; resume from a state whose weights "
                           "match")


def _first_non_finite(net):
    """Where a NaN or infinity first appears: forward outputs in layer order, then gradients in
    backward order."""
    for layer, top in zip(net.layers, net.top_vecs):
        for blob in top:
            if not np.isfinite(blob.data).all():
                return f"layer '{layer.name}' ({layer.type}) produced a non-finite value in " \
                       f"its output '{blob.name}' (forward)"
    for i in reversed(range(len(net.layers))):
        layer = net.layers[i]
        for k, blob in enumerate(layer.blobs):
            if not np.isfinite(blob.diff).all():
                return f"layer '{layer.name}' ({layer.type}) has a non-finite gradient in " \
                       f"parameter {k} (backward)"
        for blob, need in zip(net.bottom_vecs[i], net.bottom_need_backward[i]):
            if need and not np.isfinite(blob.diff).all():
                return f"layer '{layer.name}' ({layer.type}) produced a non-finite gradient " \
                       f"for '{blob.name}' (backward)"
    return "the loss is not finite"


def _seek(net, batches):
    for layer in net.layers:
        seek = getattr(layer, "seek", None)
        if seek is not None:
            seek(batches)


def load_solver_param(solver):
    """A SolverParameter from a path or a message, with Caffe's default snapshot_prefix."""
    param, source = load_message(solver, pb.SolverParameter)
    if not param.snapshot_prefix and not source.startswith("<"):
        param.snapshot_prefix = os.path.splitext(source)[0]
    _check_counts(param, source)
    return param, source


def _check_counts(param, source):
    """Counts the loop divides by or counts down with, checked before any net is built."""
    for name in ("iter_size", "average_loss"):
        if getattr(param, name) < 1:
            raise PrototxtError(f"{source}: {name} is {getattr(param, name)}; it must be at "
                                "least 1")
    if param.max_iter < 0:
        raise PrototxtError(f"{source}: max_iter is {param.max_iter}; it must not be negative")
    for name in ("display", "snapshot", "test_interval"):
        if getattr(param, name) < 0:
            raise PrototxtError(f"{source}: {name} is {getattr(param, name)}; it must not be "
                                "negative (0 turns it off)")
    for k, iterations in enumerate(param.test_iter):
        if iterations < 1:
            raise PrototxtError(f"{source}: test_iter #{k} is {iterations}; each test pass needs "
                                "at least 1 iteration")
    if param.lr_policy == "poly" and param.max_iter < 1:
        raise PrototxtError(f"{source}: lr_policy 'poly' decays to 0 at max_iter, which is "
                            f"{param.max_iter}; set max_iter to at least 1")


class Terminated(Exception):
    """Training ended at an iteration boundary because the job was sent SIGTERM, after the
    snapshot its effect asked for. `snapshot`: the last state written, on rank 0 (None on the
    other ranks, and when none was)."""

    def __init__(self, iteration, snapshot):
        self.iteration = iteration
        self.snapshot = snapshot
        super().__init__(f"SIGTERM: training ended at iteration {iteration}" +
                         (f"; the last snapshot is {snapshot}" if snapshot else ""))


class _SignalActions:
    """SIGINT, SIGHUP and SIGTERM during training, as Caffe's -sigint_effect / -sighup_effect
    (solver.signal_effects): by default SIGINT stops after the current iteration (with a
    snapshot) and SIGHUP snapshots; "none" ignores the signal. SIGTERM is what a scheduler sends
    before it kills a job (Slurm's preemption, time limit, scancel): its effect is done, then
    training ends with Terminated, "snapshot" (the default) writing one first and "stop" not. A
    signal on one rank is a request to the whole job (solver.sync), taken by every rank at the
    same iteration boundary."""

    def __init__(self, solver):
        self.solver = solver
        self.saved = {}

    def __enter__(self):
        import threading
        if threading.current_thread() is not threading.main_thread():
            return self
        for name, effect in self.solver.signal_effects.items():
            if not hasattr(signal, name):
                continue
            sig = getattr(signal, name)
            handler = signal.SIG_IGN if effect == "none" else self._handler(name, effect)
            self.saved[sig] = signal.signal(sig, handler)
        return self

    def _handler(self, name, effect):
        requests = (effect, "terminate") if name == "SIGTERM" else (effect,)

        def handle(signum, frame):
            for request in requests:
                self.solver.sync.request(request)
        return handle

    def __exit__(self, *exc):
        for sig, handler in self.saved.items():
            signal.signal(sig, handler)
        return False
