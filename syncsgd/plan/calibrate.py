"""`syncsgd plan --calibrate`: measure this machine and write its cluster file, to this host's
cache (cluster.cache_path(), which training plans with; rerun to redo it) and to --out if given.

What is measured, and how:
- peak_flops: the best rate of a large float32 matrix product (numpy's BLAS, all cores).
- efficiency per layer type: every layer of the calibration nets is timed forward and backward
  with syncsgd.timing.time_net (what `syncsgd time` runs); its planner FLOPs over its time is its
  rate, recorded per layer shape; a type's efficiency is its FLOP-weighted rate over peak_flops.
  The layers that training carries in lanes (syncsgd.lanes) get the share of a whole pass's time
  that the lanes take instead. Timed again with one thread, for ranks that share this host's
  cores.
- memory_bandwidth: a large array copy (bytes read + written per second).
- jitter: the relative spread of whole forward-backward iterations (1.4826 times the median
  absolute deviation over the median, which bursts of other work on the host do not inflate;
  median over the nets).
- network: `mpiexec -n 2` on this host (loopback / shared memory): latency and bandwidth fitted
  to allreduce times from 8 B to 16 MiB, ov from a simultaneous exchange against a one-way send.
  The allreduce times are recorded next to what the planner's collective model predicts.
"""
import contextlib
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import time

import numpy as np

from syncsgd.plan.cluster import ClusterError

CALIBRATION_MODELS = (("cifar10_quick", 100), ("lenet", 64), ("alexnet", 4), ("cddnn", 256))

_MPI_SCRIPT = r"""
import json
import numpy as np
from mpi4py import MPI
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
peer = 1 - rank
out = {"one_way": {}, "exchange": {}, "allreduce": {}}
for nbytes in [8, 64, 512, 4096, 32768, 262144, 2097152, 16777216]:
    a = np.ones(max(nbytes // 4, 2), np.float32)
    b = np.empty_like(a)
    reps = max(5, min(200, int(4e7 // nbytes)))
    for kind in out:
        best = float("inf")
        for _ in range(reps):
            comm.Barrier()
            t = MPI.Wtime()
            if kind == "one_way":
                if rank == 0:
                    comm.Send(a, dest=1); comm.Recv(b, source=1)
                else:
                    comm.Recv(b, source=0); comm.Send(a, dest=0)
                elapsed = (MPI.Wtime() - t) / 2
            elif kind == "exchange":
                comm.Sendrecv(a, dest=peer, recvbuf=b, source=peer)
                elapsed = MPI.Wtime() - t
            else:
                comm.Allreduce(a, b, op=MPI.SUM)
                elapsed = MPI.Wtime() - t
            best = min(best, comm.allreduce(elapsed, op=MPI.MAX))
        out[kind][a.nbytes] = best
if rank == 0:
    print(json.dumps(out))
"""


def find_mpiexec():
    """mpiexec beside this interpreter (the mpich wheel's, matching mpi4py), else on PATH."""
    beside = os.path.join(sysconfig.get_path("scripts"), "mpiexec")
    if os.path.isfile(beside) and os.access(beside, os.X_OK):
        return beside
    found = shutil.which("mpiexec")
    if found:
        return found
    raise ClusterError("--calibrate: no mpiexec found beside this Python or on PATH; install "
                       "MPI (pip install mpich) or write the network section of the cluster "
                       "file by hand")


def measure_network(timeout=300):
    """{"one_way", "exchange", "allreduce"}: {bytes: seconds} from two ranks on this host."""
    command = [find_mpiexec(), "-n", "2", sys.executable, "-m", "mpi4py", "-c", _MPI_SCRIPT]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise ClusterError(f"--calibrate: the MPI measurement took over {timeout} s") from None
    if done.returncode != 0:
        raise ClusterError(f"--calibrate: {' '.join(command[:3])} ... failed "
                           f"({done.returncode}): {done.stderr.strip()[-2000:]}")
    raw = json.loads(done.stdout.strip().splitlines()[-1])
    return {kind: {int(n): t for n, t in table.items()} for kind, table in raw.items()}


def network_parameters(measured):
    """(latency, bandwidth, overlap) from measure_network's tables.

    ov compares a simultaneous exchange with a one-way send of the largest message. Latency and
    bandwidth are fitted to the allreduce times, since gradient allreduces are what a plan mostly
    prices: the planner's two-rank allreduce is t = 2 alpha + n (2 - ov) / BW, so alpha is half
    the smallest message's time and BW comes from messages of 256 KiB and more (median).
    """
    one_way, exchange, allreduce = measured["one_way"], measured["exchange"], measured["allreduce"]
    large = max(one_way)
    overlap = min(1.0, max(0.0, 2.0 - exchange[large] / one_way[large]))
    latency = allreduce[min(allreduce)] / 2.0
    per_byte = np.median([(t - 2.0 * latency) / n for n, t in allreduce.items() if n >= 1 << 18])
    bandwidth = (2.0 - overlap) / max(float(per_byte), 1e-15)
    return latency, bandwidth, overlap


def measure_peak_flops(seconds=2.0):
    """Best FLOP/s of float32 square matrix products within about `seconds`."""
    best = 0.0
    deadline = time.perf_counter() + seconds
    for n in (256, 512, 1024, 2048):
        a = np.ones((n, n), np.float32)
        b = np.ones((n, n), np.float32)
        c = np.empty((n, n), np.float32)
        np.matmul(a, b, out=c)
        for _ in range(3):
            t = time.perf_counter()
            np.matmul(a, b, out=c)
            best = max(best, 2.0 * n ** 3 / (time.perf_counter() - t))
        if time.perf_counter() > deadline:
            break
    return best


def measure_memory_bandwidth(nbytes=64 << 20):
    """Bytes per second of a large copy (read + write)."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.ones_like(src)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return 2.0 * nbytes / best


def measure_layers(model, batch, iterations=3, rounds=3):
    """(per-layer records, per-iteration seconds) from timing `model` at `batch` samples with
    all cores, and with one thread (what each of N >= cores ranks on this host gets).

    Rounds alternate the two settings; each layer keeps its fastest round, so that a burst of
    other work on the host does not pass for the layer's speed.
    """
    from syncsgd import TRAIN
    from syncsgd.kernels.threads import limited_budget
    from syncsgd.net import Net
    from syncsgd.plan.costs import net_costs, planning_param
    from syncsgd.timing import time_net
    param, _ = planning_param(model, batch=batch, fillers=True)
    param.force_backward = True
    net = Net(param, TRAIN)
    rng = np.random.default_rng(0)
    for name in net.inputs:
        data = net.blobs[name].data
        data[...] = 0 if "label" in name else rng.standard_normal(data.shape)
    totals = []
    best = {"all": None, "one": None}
    whole = float("inf")
    for _ in range(rounds):
        with limited_budget(1):
            single = time_net(net, iterations)
        passes = []     # whole passes on every thread, lanes engaged (last, for _lane_rates)
        report = time_net(net, iterations, progress=lambda it, s: passes.append(s))
        totals += passes
        for key, timed in (("all", report), ("one", single)):
            seconds = np.array([(t["forward_ms"] + t["backward_ms"]) / 1e3
                                for t in timed["layers"]])
            best[key] = seconds if best[key] is None else np.minimum(best[key], seconds)
        whole = min(whole, min(passes))
    _lane_rates(net, best["all"], whole)
    records = []
    for cost, seconds, alone in zip(net_costs(net, batch), best["all"], best["one"]):
        if cost.flops_per_sample <= 0 or seconds <= 0:
            continue
        records.append({"model": str(model), "layer": cost.name, "type": cost.type,
                        "shape": cost.shape_key(), "batch": batch, "flops": cost.flops(batch),
                        "seconds": float(seconds), "flops_per_s": cost.flops(batch) / seconds,
                        "seconds_one_core": float(alone)})
    return records, totals


def _lane_rates(net, seconds, whole):
    """Scale the all-core times of the layers lanes carry (syncsgd.lanes) to what they take in
    training: time_net runs each layer alone, its kernels shared out over the threads, while a
    whole pass carries the run in lanes, each thread its part of the batch. The run takes the
    whole pass's time less the other layers' (`seconds`, in place; `whole`: a pass's
    seconds)."""
    run = net.lanes.run
    if run is None or net.lanes.engaged is None:
        return
    inside = slice(run[0], run[1] + 1)
    alone = float(seconds[inside].sum())
    in_lanes = whole - (float(seconds.sum()) - alone)
    if alone > 0 and 0 < in_lanes < alone:
        seconds[inside] *= in_lanes / alone


def _type_efficiency(records, key, peak):
    by_type = {}
    for r in records:
        flops, seconds = by_type.get(r["type"], (0.0, 0.0))
        by_type[r["type"]] = (flops + r["flops"], seconds + r[key])
    return {t: round(f / s / peak, 5) for t, (f, s) in sorted(by_type.items()) if s > 0}


def calibrate(models=CALIBRATION_MODELS, iterations=3, progress=print):
    """The this-machine cluster file as a dict (see cluster.py for the format)."""
    progress("measuring the float32 GEMM peak ...")
    peak = measure_peak_flops()
    progress("measuring memory bandwidth ...")
    memory = measure_memory_bandwidth()
    records, jitters = [], []
    for model, batch in models:
        progress(f"timing {model} at batch {batch} ...")
        layer_records, totals = measure_layers(model, batch, iterations)
        records += layer_records
        if len(totals) > 2:     # robust spread: 1.4826 * median absolute deviation
            middle = np.median(totals)
            jitters.append(float(1.4826 * np.median(np.abs(np.array(totals) - middle)) / middle))
    peak = max([peak] + [r["flops_per_s"] for r in records])
    efficiency = {"default": 1.0, **_type_efficiency(records, "seconds", peak)}
    one_core = _type_efficiency(records, "seconds_one_core", peak)
    for r in records:
        r["efficiency"] = round(r["flops_per_s"] / peak, 5)
    progress("measuring MPI between two ranks on this host ...")
    network = measure_network()
    latency, bandwidth, overlap = network_parameters(network)
    jitter = float(np.median(jitters)) if jitters else 0.0
    when = datetime.date.today().isoformat()
    host = f"{platform.node()} ({platform.processor() or platform.machine()}, " \
           f"{os.cpu_count()} cores)"
    measured = f"measured by `syncsgd plan --calibrate` on {when} on {host}"
    cluster = {
        "name": "this-machine",
        "description": "This host, with every rank of an mpiexec job on it (shared_host): "
                       "ranks share its cores and memory bandwidth and talk through MPI's "
                       "shared-memory transport.",
        "node": {"peak_flops": peak, "cores": os.cpu_count() or 1, "comm_cores": 0,
                 "memory_bandwidth": memory, "efficiency": efficiency,
                 "efficiency_one_core": one_core, "jitter": jitter, "shared_host": True},
        "network": {"bandwidth": bandwidth, "latency": latency, "overlap": overlap,
                    "allreduce": "auto"},
        "runtime": {"update": "replicated"},
        "sources": {
            "node.peak_flops": f"{measured}: best float32 matrix product (numpy BLAS)",
            "node.cores": "os.cpu_count()",
            "node.comm_cores": "syncsgd drives MPI from a thread, no core is set aside",
            "node.memory_bandwidth": f"{measured}: 64 MiB numpy copy, read + write bytes",
            "node.efficiency": f"{measured}: FLOP-weighted rate of each layer type in "
                               f"syncsgd.timing.time_net over peak_flops; see measurements",
            "node.jitter": f"{measured}: relative spread (1.4826 MAD / median) of iteration "
                           f"times, median over the nets",
            "node.efficiency_one_core": f"{measured}: the same with BLAS and numexpr limited "
                                        f"to one thread",
            "node.shared_host": "all ranks run on this one host",
            "network.latency": f"{measured}: allreduce of 8 B .. 16 MiB on mpiexec -n 2, "
                               f"fitted (see measurements)",
            "network.bandwidth": f"{measured}: the same allreduce fit",
            "network.overlap": f"{measured}: 2 - (exchange time / one-way time) at 16 MiB",
            "network.allreduce": "MPICH picks its algorithm by message size",
            "runtime.update": "syncsgd's default reduction is ALLREDUCE: every rank updates "
                              "all weights",
        },
        "measurements": {"load_average": os.getloadavg(), "layers": records, "mpi_seconds": {
            kind: {str(n): t for n, t in table.items()} for kind, table in network.items()}},
    }
    _record_allreduce_model(cluster, network["allreduce"])
    return cluster


def _record_allreduce_model(cluster, allreduce):
    """Put the collective model's allreduce predictions beside the measured ones."""
    from syncsgd.plan.balance import allreduce_time
    from syncsgd.plan.cluster import cluster_from_dict
    model = cluster_from_dict(cluster)
    cluster["measurements"]["allreduce_2_ranks"] = [
        {"bytes": n, "measured_s": t, "model_s": allreduce_time(n, 2, model)}
        for n, t in sorted(allreduce.items())]


def write_cluster(cluster, path):
    """Write the cluster file whole or not at all (a run starting meanwhile reads the old one)."""
    partial = f"{path}.{os.getpid()}.partial"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(partial, "w") as f:
            json.dump(cluster, f, indent=2)
            f.write("\n")
        os.replace(partial, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.remove(partial)
        raise ClusterError(f"--calibrate: cannot write {path}: {e.strerror}; give --out FILE "
                           "(or set XDG_CACHE_HOME to a writable folder) and train with "
                           "SYNCSGD_CLUSTER=FILE") from None
    return path
