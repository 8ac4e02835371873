"""`syncsgd test`: score trained weights on a net's TEST-phase data, as `caffe test` does."""
import numpy as np

from syncsgd import TEST, log
from syncsgd.net import Net
from syncsgd.parallel import default_sync


def evaluate(model, weights, iterations, sync=None):
    """Mean of every output over `iterations` batches; logs Caffe's `caffe test` lines. Under an
    MPI launch each rank scores its slice of every batch and the means are global (`sync` as for
    a Solver)."""
    ctx = (sync or default_sync()).context(TEST, 0)
    net = Net(model, TEST, weights=weights, ctx=ctx)
    log.info(f"Running for {iterations} iterations.")
    sums = None
    loss = 0.0
    for i in range(iterations):
        ctx.iteration = i
        net.forward()
        loss += net.loss
        values = [net.blobs[name].data.astype(np.float64).ravel() for name in net.outputs]
        sums = values if sums is None else [s + v for s, v in zip(sums, values)]
        for name, value in zip(net.outputs, values):
            for v in value:
                log.info(f"Batch {i}, {name} = {log.fmt(v)}")
    log.info(f"Loss: {log.fmt(loss / iterations)}")
    means = {}
    weights = net.blob_loss_weights
    for name, total in zip(net.outputs, sums or []):
        mean = total / iterations
        means[name] = mean
        weight = weights[name]
        for v in mean:
            extra = f" (* {log.fmt(weight)} = {log.fmt(weight * v)} loss)" if weight else ""
            log.info(f"{name} = {log.fmt(v)}{extra}")
    net.close()
    return means
