"""Python layers as pycaffe users write them (Caffe's examples/pycaffe/layers): a Euclidean loss
and a data layer serving batches of arrays, configured through param_str."""
import json

import numpy as np

import syncsgd as caffe
from digits import mnist_like


class EuclideanLossLayer(caffe.Layer):
    """Half the squared distance between two bottoms, per sample."""

    def setup(self, bottom, top):
        if len(bottom) != 2:
            raise Exception("Need two inputs to compute distance.")

    def reshape(self, bottom, top):
        if bottom[0].count != bottom[1].count:
            raise Exception("Inputs must have the same dimension.")
        self.diff = np.zeros_like(bottom[0].data, dtype=np.float32)
        top[0].reshape(1)

    def forward(self, bottom, top):
        self.diff[...] = bottom[0].data - bottom[1].data
        top[0].data[...] = np.sum(self.diff ** 2) / bottom[0].num / 2.

    def backward(self, top, propagate_down, bottom):
        for i in range(2):
            if not propagate_down[i]:
                continue
            sign = 1 if i == 0 else -1
            bottom[i].diff[...] = sign * self.diff / bottom[i].num


class DigitsDataLayer(caffe.Layer):
    """Serves consecutive batches of the digits; param_str is JSON: {"batch_size": N}."""

    def setup(self, bottom, top):
        params = json.loads(self.param_str)
        self.batch_size = params['batch_size']
        self.images, self.labels = mnist_like(count=params.get('count', 500))
        self.index = 0

    def reshape(self, bottom, top):
        top[0].reshape(self.batch_size, 1, 28, 28)
        top[1].reshape(self.batch_size)

    def forward(self, bottom, top):
        rows = (self.index + np.arange(self.batch_size)) % len(self.labels)
        top[0].data[...] = self.images[rows, None]
        top[1].data[...] = self.labels[rows]
        self.index = (self.index + self.batch_size) % len(self.labels)

    def backward(self, top, propagate_down, bottom):
        pass
