"""Fine-tuning, written as Caffe's 02-fine-tuning notebook does it: the pretrained LeNet's layers
copied by name into a new net whose classifier is renamed (so it starts from its filler) and
sized for a new task, trained next to the same net from scratch; the pretrained start wins.

Usage: fine_tune.py WEIGHTS_DIR (holding lenet.prototxt and lenet_iter_10000.caffemodel)."""
import os
import sys

import numpy as np

import syncsgd as caffe
from syncsgd import layers as L, params as P
from digits import mnist_like, write_hdf5

weights = os.path.join(sys.argv[1], 'lenet_iter_10000.caffemodel')
caffe.set_mode_cpu()

# the new task: tell digits 5..9 apart (5 classes), from few examples
images, labels = mnist_like()
keep = labels >= 5
images, labels = images[keep], labels[keep] - 5
train = write_hdf5('five_train.h5', images[:100], labels[:100])
test = write_hdf5('five_test.h5', images[500:800], labels[500:800])


def lenet_five(source, batch_size):
    n = caffe.NetSpec()
    n.data, n.label = L.HDF5Data(batch_size=batch_size, source=source, ntop=2)
    n.conv1 = L.Convolution(n.data, kernel_size=5, num_output=20, weight_filler=dict(type='xavier'))
    n.pool1 = L.Pooling(n.conv1, kernel_size=2, stride=2, pool=P.Pooling.MAX)
    n.conv2 = L.Convolution(n.pool1, kernel_size=5, num_output=50, weight_filler=dict(type='xavier'))
    n.pool2 = L.Pooling(n.conv2, kernel_size=2, stride=2, pool=P.Pooling.MAX)
    n.ip1 = L.InnerProduct(n.pool2, num_output=500, weight_filler=dict(type='xavier'))
    n.relu1 = L.ReLU(n.ip1, in_place=True)
    n.ip2_five = L.InnerProduct(n.relu1, num_output=5, weight_filler=dict(type='xavier'))
    n.loss = L.SoftmaxWithLoss(n.ip2_five, n.label)
    n.accuracy = L.Accuracy(n.ip2_five, n.label, include=dict(phase=caffe.TEST))
    return n.to_proto()


with open('five_train.prototxt', 'w') as f:
    f.write(str(lenet_five(train, 20)))
with open('five_test.prototxt', 'w') as f:
    f.write(str(lenet_five(test, 100)))


def solver(prefix):
    path = prefix + '_solver.prototxt'
    with open(path, 'w') as f:
        f.write('train_net: "five_train.prototxt"\ntest_net: "five_test.prototxt"\n'
                'test_iter: 3\ntest_interval: 1000\nbase_lr: 0.005\nmomentum: 0.9\n'
                'lr_policy: "fixed"\nmax_iter: 1000\nsnapshot: 0\nrandom_seed: 3\n'
                'snapshot_prefix: "%s"\n' % prefix)
    return caffe.get_solver(path)


pretrained = solver('pretrained')
pretrained.net.copy_from(weights)
scratch = solver('scratch')
source = caffe.Net(os.path.join(sys.argv[1], 'lenet.prototxt'), weights, caffe.TEST)
assert np.array_equal(pretrained.net.params['conv1'][0].data, source.params['conv1'][0].data)
assert not np.array_equal(scratch.net.params['conv1'][0].data, source.params['conv1'][0].data)


def accuracy(s):
    return np.mean([s.test_nets[0].forward()['accuracy'] for _ in range(3)])


for name, s in (('pretrained', pretrained), ('scratch', scratch)):
    s.step(10)
results = {'pretrained': accuracy(pretrained), 'scratch': accuracy(scratch)}
print('accuracy after 10 steps', results)
assert results['pretrained'] >= 0.8 and results['pretrained'] > results['scratch']
print('ok')
