"""Cluster files: what a node computes and how fast its network moves bytes.

A cluster file is JSON (no dependency beyond the standard library):

    {
      "name": "paper-fdr",
      "node": {"peak_flops": 2.33e12,            # FLOP/s of one node, fp32
               "cores": 28, "comm_cores": 2,     # cores reserved to drive communication
               "memory_bandwidth": 1.1e11,       # bytes/s (optional: the roofline's memory side)
               "efficiency": {"Convolution": 0.7, "InnerProduct": 0.7, "default": 0.7},
               "jitter": 0.05,                   # run-to-run variation of a node's compute time
               "shared_host": false,             # true: the N "nodes" are ranks on ONE host,
                                                 # sharing its cores and memory bandwidth
               "efficiency_one_core": {...}},    # shared host: what one thread reaches
      "network": {"bandwidth": 6.8e9,            # bytes/s per node and direction
                  "latency": 1e-6,               # seconds per message (alpha)
                  "overlap": 1.0,                # ov: fraction of send and receive that overlap
                  "allreduce": "ring"},          # ring | recursive_halving | auto (the faster)
      "runtime": {"update": "sharded"},          # sharded: each node updates 1/N of a layer's
                                                 # weights; replicated: every node all of them
      "sources": {"node.peak_flops": "where the number comes from", ...}
    }

Shipped files live in syncsgd/plan/clusters/ and are named without ".json" (paper-fdr,
paper-10gbe, this-machine). `syncsgd plan --calibrate` keeps its measurement of a host in that
host's cache file (cache_path()), which training prefers to the shipped this-machine.
"""
import copy
import json
import os
import socket
from dataclasses import dataclass, field

from syncsgd.errors import SyncSGDError

CLUSTER_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "clusters")
ALLREDUCE_ALGORITHMS = ("ring", "recursive_halving", "auto")
UPDATE_MODES = ("sharded", "replicated")


class ClusterError(SyncSGDError):
    """A cluster file that is missing, is not JSON, or lacks a field."""


@dataclass
class Cluster:
    name: str
    peak_flops: float
    efficiency: dict
    bandwidth: float
    latency: float
    overlap: float = 0.0
    allreduce: str = "ring"
    cores: int = 1
    comm_cores: int = 0
    memory_bandwidth: float = None
    jitter: float = 0.0
    shared_host: bool = False
    update: str = "replicated"
    efficiency_one_core: dict = field(default_factory=dict)  # shared host: one thread's share
    shape_efficiency: dict = field(default_factory=dict)   # layer shape key -> measured share
    shape_efficiency_one_core: dict = field(default_factory=dict)
    sources: dict = field(default_factory=dict)
    path: str = ""
    raw: dict = field(default_factory=dict)

    def efficiency_of(self, layer_type, shape=None, one_core=False):
        """Share of peak_flops reached on a layer: measured for its exact shape if the file has
        it, else for its type, else "default"; with `one_core`, by one thread (shared host)."""
        by_shape, by_type = ((self.shape_efficiency_one_core, self.efficiency_one_core)
                             if one_core else (self.shape_efficiency, self.efficiency))
        found = by_shape.get(shape) or by_type.get(layer_type)
        if found is None and one_core:
            return self.efficiency_of(layer_type, shape) / self.cores
        return float(found if found is not None else by_type.get("default", 1.0))

    def core_fraction(self, nodes):
        """Share of a node's cores that compute: all on one node, fewer when some drive MPI."""
        if nodes <= 1:
            return 1.0
        return (self.cores - self.comm_cores) / self.cores

    def compute_rate(self, layer_type, nodes=1, shape=None):
        """Achieved FLOP/s of one node (F in the paper) on a layer of this type and shape.

        On a shared host each of N ranks gets cores / N threads (as syncsgd sets them): its
        efficiency goes linearly from one thread's (measured) at one core to the whole host's
        at all cores, and below one core it gets its time slice of one."""
        efficiency = self.efficiency_of(layer_type, shape)
        if self.shared_host and nodes > 1:
            threads = self.cores / nodes
            one = self.efficiency_of(layer_type, shape, one_core=True)
            if threads >= 1:
                span = (threads - 1) / (self.cores - 1) if self.cores > 1 else 1.0
                efficiency = one + (efficiency - one) * span
            else:
                efficiency = one * threads
        return self.peak_flops * efficiency * self.core_fraction(nodes)

    def node_memory_bandwidth(self, nodes=1):
        """Bytes/s of memory traffic one node (or one of N ranks on a shared host) gets."""
        if self.memory_bandwidth is None:
            return None
        if self.shared_host:
            return self.memory_bandwidth * min(1.0, self.cores / max(nodes, 1))
        return self.memory_bandwidth

    def with_overrides(self, node_flops=None, bandwidth=None, overlap=None):
        """A copy with command-line overrides applied (and noted in its sources)."""
        out = copy.deepcopy(self)
        for attr, value in (("peak_flops", node_flops), ("bandwidth", bandwidth),
                            ("overlap", overlap)):
            if value is not None:
                setattr(out, attr, float(value))
                out.sources[attr] = "given on the command line"
        out.validate()
        return out

    def validate(self):
        where = self.path or self.name
        for attr in ("peak_flops", "bandwidth"):
            if not getattr(self, attr) > 0:
                raise ClusterError(f"{where}: {attr} must be a positive number")
        if self.latency < 0:
            raise ClusterError(f"{where}: network.latency must be >= 0 seconds")
        if not 0.0 <= self.overlap <= 1.0:
            raise ClusterError(f"{where}: network.overlap (ov) must be in [0, 1], got "
                               f"{self.overlap}")
        if self.allreduce not in ALLREDUCE_ALGORITHMS:
            raise ClusterError(f"{where}: network.allreduce must be one of "
                               f"{', '.join(ALLREDUCE_ALGORITHMS)}, got '{self.allreduce}'")
        if self.update not in UPDATE_MODES:
            raise ClusterError(f"{where}: runtime.update must be one of "
                               f"{', '.join(UPDATE_MODES)}, got '{self.update}'")
        if not 0 <= self.comm_cores < self.cores:
            raise ClusterError(f"{where}: node.comm_cores ({self.comm_cores}) must be at least 0 "
                               f"and fewer than node.cores ({self.cores})")
        if not 0.0 <= self.jitter < 1.0:
            raise ClusterError(f"{where}: node.jitter must be in [0, 1), got {self.jitter}")
        if self.memory_bandwidth is not None and not self.memory_bandwidth > 0:
            raise ClusterError(f"{where}: node.memory_bandwidth must be positive or left out")
        for name, value in self.efficiency.items():
            if not 0 < float(value) <= 1:
                raise ClusterError(f"{where}: node.efficiency.{name} must be in (0, 1], got "
                                   f"{value}")
        return self


def cluster_path(spec, given_as="--cluster"):
    """The file a --cluster value (or SYNCSGD_CLUSTER, `given_as`) names: a path, or a shipped
    cluster's name."""
    spec = os.fspath(spec)
    if os.path.isfile(spec):
        return spec
    shipped = os.path.join(CLUSTER_DIR, spec if spec.endswith(".json") else spec + ".json")
    if os.path.isfile(shipped):
        return shipped
    raise ClusterError(f"{given_as} {spec}: no such file and no shipped cluster of that name "
                       f"(shipped: {', '.join(shipped_clusters())})")


def cache_path():
    """This host's calibration, as `syncsgd plan --calibrate` writes it:
    ${XDG_CACHE_HOME:-~/.cache}/syncsgd/cluster-<hostname>.json."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "syncsgd", f"cluster-{socket.gethostname()}.json")


def shipped_clusters():
    return sorted(name[:-5] for name in os.listdir(CLUSTER_DIR) if name.endswith(".json"))


def load_cluster(spec, given_as="--cluster"):
    """A Cluster from a JSON file path or a shipped name."""
    path = cluster_path(spec, given_as)
    try:
        with open(path) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise ClusterError(f"{path}:{e.lineno}:{e.colno}: not valid JSON: {e.msg}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ClusterError(f"{path}: cannot read it: {getattr(e, 'strerror', None) or e}") \
            from None
    return cluster_from_dict(raw, path)


def cluster_from_dict(raw, path=""):
    where = path or "<cluster>"
    raw_dict = raw if isinstance(raw, dict) else {}
    node, network = raw_dict.get("node"), raw_dict.get("network")
    if not isinstance(node, dict) or not isinstance(network, dict):
        raise ClusterError(f"{where}: needs a \"node\" and a \"network\" object (see "
                           "docs/planner.md for the format)")

    def need(section, key, name):
        if key not in section:
            raise ClusterError(f"{where}: missing {name}.{key}")
        return section[key]

    peak = need(node, "peak_flops", "node")
    try:
        records = raw.get("measurements", {}).get("layers", [])
        efficiency = dict(node.get("efficiency", {}))
        efficiency.setdefault("default", 1.0)
        runtime = raw.get("runtime", {})
        cluster = Cluster(
            name=raw.get("name", os.path.splitext(os.path.basename(where))[0]),
            peak_flops=float(peak),
            efficiency={k: float(v) for k, v in efficiency.items()},
            bandwidth=float(need(network, "bandwidth", "network")),
            latency=float(network.get("latency", 0.0)),
            overlap=float(network.get("overlap", 0.0)),
            allreduce=network.get("allreduce", "ring"),
            cores=int(node.get("cores", 1)),
            comm_cores=int(node.get("comm_cores", 0)),
            memory_bandwidth=(float(node["memory_bandwidth"])
                              if node.get("memory_bandwidth") is not None else None),
            jitter=float(node.get("jitter", 0.0)),
            shared_host=bool(node.get("shared_host", False)),
            update=runtime.get("update", "replicated"),
            efficiency_one_core={k: float(v)
                                 for k, v in node.get("efficiency_one_core", {}).items()},
            shape_efficiency=_shape_efficiency(records, peak, "seconds"),
            shape_efficiency_one_core=_shape_efficiency(records, peak, "seconds_one_core"),
            sources=dict(raw.get("sources", {})),
            path=path, raw=raw)
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise ClusterError(f"{where}: a field has the wrong type or is missing: {e!r}") from None
    return cluster.validate()


def _shape_efficiency(records, peak, key):
    """Efficiency per layer shape from calibration records: FLOPs over seconds over peak."""
    totals = {}
    for r in records:
        if r.get(key):
            flops, seconds = totals.get(r["shape"], (0.0, 0.0))
            totals[r["shape"]] = (flops + r["flops"], seconds + r[key])
    return {shape: min(1.0, flops / seconds / float(peak))
            for shape, (flops, seconds) in totals.items() if seconds > 0}
