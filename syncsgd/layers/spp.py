"""SPP: spatial pyramid pooling (He et al., "Spatial Pyramid Pooling in Deep Convolutional
Networks for Visual Recognition"): a fixed-length output from any image size.

Level l of spp_param.pyramid_height pools the (N, C, H, W) bottom into 2^l x 2^l bins; the
levels are flattened and joined into (N, C * sum(4^l)), or with one level the top is the
pooled (N, C, 1, 1). As Caffe's SPPLayer does, the layer is built from Pooling layers, one per
level, whose kernel, stride and padding follow from the bottom's size (rebuilt when it
changes), then Flatten and Concat.
"""
import numpy as np

from syncsgd.blob import Blob
from syncsgd.layers.base import Layer
from syncsgd.layers.concat import Concat
from syncsgd.layers.flatten import Flatten
from syncsgd.layers.pooling import PoolingLayer
from syncsgd.layers.registry import register
from syncsgd.proto import pb

_SPP = pb.SPPParameter


def level_pooling(level, size, pool):
    """Caffe's SPPLayer::GetPoolingParam: 2^level bins per side, each ceil(size / bins) wide
    with stride equal to the kernel, padded by half the shortfall (rounded up) on each side."""
    bins = 2 ** level
    kernel = [-(-s // bins) for s in size]
    pad = [(k * bins - s + 1) // 2 for k, s in zip(kernel, size)]
    method = pb.PoolingParameter.PoolMethod.Value(_SPP.PoolMethod.Name(pool))
    return pb.PoolingParameter(pool=method, kernel_h=kernel[0], kernel_w=kernel[1],
                               stride_h=kernel[0], stride_w=kernel[1], pad_h=pad[0],
                               pad_w=pad[1])


@register
class SPP(Layer):
    type = "SPP"
    exact_bottoms = 1
    exact_tops = 1

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        p = self.param.spp_param
        self.height = p.pyramid_height
        if self.height < 1:
            self.fail("spp_param.pyramid_height must be set to 1 or more (the number of "
                      "pyramid levels)")
        if p.pool not in (_SPP.MAX, _SPP.AVE):
            self.fail("spp_param.pool STOCHASTIC is not supported; use MAX or AVE")
        self.size = None

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        if len(shape) != 4:
            self.fail(f"bottom must have 4 axes (num, channels, height, width), got {shape}")
        if min(shape[2:]) <= 0:
            self.fail(f"bottom {shape} has an empty image")
        if shape[2:] != self.size:
            self._build(bottom, top, shape[2:])
            self.size = shape[2:]
        if self.height == 1:
            self.pooling[0].reshape(bottom, top)
            return
        for pool, inputs, pooled, flat in zip(self.pooling, self.inputs, self.pooled, self.flat):
            inputs[0].data = bottom[0].data
            pool.reshape(inputs, pooled)
            self.flatten.reshape(pooled, flat)
        self.concat.reshape([f[0] for f in self.flat], top)
        self.inputs[0][0].diff = bottom[0].diff
        for inputs in self.inputs[1:]:
            if inputs[0].diff.shape != shape:
                inputs[0].diff = np.empty(shape, np.float32)

    def _build(self, bottom, top, size):
        """One Pooling layer per level for images of `size`; with several levels, also their
        bottoms (bottom 0's data, a diff of their own), tops and flattened tops."""
        self.pooling, self.inputs, self.pooled, self.flat = [], [], [], []
        pool = self.param.spp_param.pool
        for level in range(self.height):
            param = pb.LayerParameter(name=f"{self.name}/level{level}", type="Pooling",
                                      pooling_param=level_pooling(level, size, pool))
            p = param.pooling_param
            if p.pad_h >= p.kernel_h or p.pad_w >= p.kernel_w:
                self.fail(f"spp_param.pyramid_height {self.height} is too high for a "
                          f"{size[0]}x{size[1]} image: level {level}'s "
                          f"{2 ** level} bins per side would need padding of at least the "
                          f"kernel; lower pyramid_height")
            layer = PoolingLayer(param, self.ctx)
            inputs = bottom if self.height == 1 else [Blob(name=f"{param.name}.bottom")]
            pooled = [Blob(name=param.name)]
            layer.setup(inputs, pooled)
            self.pooling.append(layer)
            self.inputs.append(inputs)
            self.pooled.append(pooled)
            self.flat.append([Blob(name=f"{param.name}.flat")])
        if self.height == 1:
            return
        self.flatten = Flatten(pb.LayerParameter(name=f"{self.name}/flatten", type="Flatten"),
                               self.ctx)
        self.flatten.setup(self.pooled[0], self.flat[0])
        self.concat = Concat(pb.LayerParameter(name=f"{self.name}/concat", type="Concat"),
                             self.ctx)
        self.concat.setup([f[0] for f in self.flat], top)

    def forward(self, bottom, top):
        if self.height == 1:
            self.pooling[0].forward(bottom, top)
            return
        for pool, inputs, pooled in zip(self.pooling, self.inputs, self.pooled):
            inputs[0].data = bottom[0].data
            pool.forward(inputs, pooled)
        self.concat.forward([f[0] for f in self.flat], top)

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        if self.height == 1:
            self.pooling[0].backward(top, propagate_down, bottom)
            return
        self.concat.backward(top, [True] * self.height, [f[0] for f in self.flat])
        # Level 0 writes into bottom 0's diff; the other levels' gradients are added to it.
        self.inputs[0][0].diff = bottom[0].diff
        for pool, inputs, pooled in zip(self.pooling, self.inputs, self.pooled):
            pool.backward(pooled, [True], inputs)
        for inputs in self.inputs[1:]:
            bottom[0].diff += inputs[0].diff
