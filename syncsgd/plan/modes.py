"""Mode choice for `parallel_param { mode: AUTO }`: the planner's data / model / hybrid layout of
each layer with weights, as ParallelParameter values the partitioner applies."""
from syncsgd.errors import SyncSGDError
from syncsgd.plan import balance
from syncsgd.plan.report import model_costs, resolve_cluster
from syncsgd.proto import pb


def choose_modes(net_param, nodes, batch=None, cluster=None):
    """{layer name: (ParallelParameter mode, groups)} for `nodes` ranks: the planner's choice for
    every layer with weights (split ones are InnerProduct layers sharing one G).

    `net_param` is a NetParameter or prototxt path, `batch` the global minibatch (default: its
    TRAIN data layer's), `cluster` a Cluster, file or shipped name (default: this-machine).
    """
    costs, data_batch = model_costs(net_param)
    batch = batch or data_batch
    if not batch:
        raise SyncSGDError("choose_modes: the net has no data layer; give the global batch")
    cluster = resolve_cluster(cluster or "this-machine")
    placements, _ = balance.Planner(costs, batch, cluster).choose(nodes)
    modes = {balance.DATA: pb.ParallelParameter.DATA, balance.MODEL: pb.ParallelParameter.MODEL,
             balance.HYBRID: pb.ParallelParameter.HYBRID}
    return {c.name: (modes[p.strategy], p.groups if p.strategy == balance.HYBRID else 1)
            for c, p in zip(costs, placements) if c.is_gemm}
