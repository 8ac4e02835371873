"""Mode choice for training on several ranks: the planner's data / model / hybrid layout of each
layer with weights, as ParallelParameter values the partitioner applies to `parallel_param
{ mode: AUTO }` and to fully connected layers whose prototxt sets no mode.

The cluster it plans for is, in this order: the file SYNCSGD_CLUSTER names (a path or a shipped
name), this host's calibration (`syncsgd plan --calibrate` writes it, cluster.cache_path()), or
the shipped this-machine. Training never calibrates: that takes minutes.
"""
import contextlib
import logging
import os

from syncsgd import log, switches
from syncsgd.errors import SyncSGDError
from syncsgd.plan import balance
from syncsgd.plan.cluster import ClusterError, cache_path, load_cluster
from syncsgd.plan.report import model_costs, resolve_cluster
from syncsgd.proto import pb

SHIPPED = "this-machine"


def training_cluster():
    """(Cluster, where it came from, for the log) that training plans for (see above).

    A broken SYNCSGD_CLUSTER is an error, since it was asked for; a broken cache only warns and
    falls back to the shipped file, since a cache must not stop a run."""
    spec = switches.cluster()
    if spec:
        cluster = load_cluster(spec, given_as=switches.CLUSTER)
        return cluster, f"{cluster.path} ({switches.CLUSTER})"
    cache = cache_path()
    if os.path.isfile(cache):
        try:
            return load_cluster(cache), cache
        except ClusterError as e:
            log.LOGGER.warning(f"{e}; planning with the shipped {SHIPPED} cluster instead. "
                               f"Delete {cache} or rerun `syncsgd plan --calibrate`")
    return load_cluster(SHIPPED), f"shipped {SHIPPED}"


def choose_modes(net_param, nodes, batch=None, cluster=None, groups=None, fixed=None):
    """{layer name: (ParallelParameter mode, groups)} for `nodes` ranks: the planner's choice for
    every layer with weights (split ones are InnerProduct layers sharing one G, `groups` if
    given), with the layers named in `fixed` {name: split?} pinned split or data-parallel.

    `net_param` is a NetParameter or prototxt path, `batch` the global minibatch (default: its
    TRAIN data layer's), `cluster` a Cluster, file or shipped name (default: training_cluster()).
    """
    with _planning_net_unlogged():
        costs, data_batch = model_costs(net_param)
    batch = batch or data_batch
    if not batch:
        raise SyncSGDError("choose_modes: the net has no data layer; give the global batch")
    cluster = resolve_cluster(cluster) if cluster is not None else training_cluster()[0]
    pins = {i: (fixed or {})[c.name] for i, c in enumerate(costs) if c.name in (fixed or {})}
    placements, _ = balance.Planner(costs, batch, cluster).choose(nodes, groups, pins)
    modes = {balance.DATA: pb.ParallelParameter.DATA, balance.MODEL: pb.ParallelParameter.MODEL,
             balance.HYBRID: pb.ParallelParameter.HYBRID}
    return {c.name: (modes[p.strategy], p.groups if p.strategy == balance.HYBRID else 1)
            for c, p in zip(costs, placements) if c.is_gemm}


@contextlib.contextmanager
def _planning_net_unlogged():
    """The net built to cost the layers is not the one that trains: keep its construction lines
    (Caffe's "Creating Layer ...") and its compile warnings, which the training net's compile
    gave already, out of the training log."""
    def errors_only(record):
        return record.levelno > logging.WARNING
    log.LOGGER.addFilter(errors_only)
    try:
        yield
    finally:
        log.LOGGER.removeFilter(errors_only)
