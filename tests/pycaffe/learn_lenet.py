"""Learning LeNet, written as Caffe's 01-learning-lenet notebook does it: the nets written with
caffe.NetSpec, an SGDSolver stepped by hand in a Python loop that records the training loss and
scores the test net, and the solver's callbacks counting what happened."""
import numpy as np

import syncsgd as caffe
from syncsgd import layers as L, params as P
from digits import mnist_like, write_hdf5


def lenet(hdf5, batch_size):
    n = caffe.NetSpec()
    n.data, n.label = L.HDF5Data(batch_size=batch_size, source=hdf5, ntop=2)
    n.conv1 = L.Convolution(n.data, kernel_size=5, num_output=20, weight_filler=dict(type='xavier'))
    n.pool1 = L.Pooling(n.conv1, kernel_size=2, stride=2, pool=P.Pooling.MAX)
    n.conv2 = L.Convolution(n.pool1, kernel_size=5, num_output=50, weight_filler=dict(type='xavier'))
    n.pool2 = L.Pooling(n.conv2, kernel_size=2, stride=2, pool=P.Pooling.MAX)
    n.fc1 = L.InnerProduct(n.pool2, num_output=500, weight_filler=dict(type='xavier'))
    n.relu1 = L.ReLU(n.fc1, in_place=True)
    n.score = L.InnerProduct(n.relu1, num_output=10, weight_filler=dict(type='xavier'))
    n.loss = L.SoftmaxWithLoss(n.score, n.label)
    return n.to_proto()


images, labels = mnist_like()
train = write_hdf5('digits_train.h5', images[:1500], labels[:1500])
test = write_hdf5('digits_test.h5', images[1500:1700], labels[1500:1700])
with open('lenet_auto_train.prototxt', 'w') as f:
    f.write(str(lenet(train, 64)))
with open('lenet_auto_test.prototxt', 'w') as f:
    f.write(str(lenet(test, 100)))
with open('lenet_auto_solver.prototxt', 'w') as f:
    f.write("""train_net: "lenet_auto_train.prototxt"
test_net: "lenet_auto_test.prototxt"
test_iter: 2
test_interval: 500
base_lr: 0.01
momentum: 0.9
weight_decay: 0.0005
lr_policy: "inv"
gamma: 0.0001
power: 0.75
display: 100
max_iter: 10000
snapshot: 5000
snapshot_prefix: "lenet"
random_seed: 7
""")

caffe.set_mode_cpu()
solver = caffe.SGDSolver('lenet_auto_solver.prototxt')
shapes = [(k, v.data.shape) for k, v in solver.net.blobs.items()]
assert shapes[:3] == [('data', (64, 1, 28, 28)), ('label', (64,)), ('conv1', (64, 20, 24, 24))]
assert [(k, v[0].data.shape) for k, v in solver.net.params.items()][0] == ('conv1', (20, 1, 5, 5))

starts, ready = [], []
solver.add_callback(lambda: starts.append(solver.iter), lambda: ready.append(solver.iter))

solver.net.forward()           # train net
solver.test_nets[0].forward()  # test net (there can be more than one)

niter = 120
test_interval = 40
train_loss = np.zeros(niter)
test_acc = np.zeros(int(np.ceil(niter / test_interval)))
for it in range(niter):
    solver.step(1)  # SGD by Caffe
    train_loss[it] = solver.net.blobs['loss'].data
    if it % test_interval == test_interval - 1:
        correct = 0
        for test_it in range(2):
            solver.test_nets[0].forward()
            correct += sum(solver.test_nets[0].blobs['score'].data.argmax(1)
                           == solver.test_nets[0].blobs['label'].data)
        test_acc[it // test_interval] = correct / 200
print('train loss', train_loss[:5].mean(), '->', train_loss[-5:].mean(), 'test accuracy', test_acc)
assert train_loss[-10:].mean() < 0.5 * train_loss[:10].mean()
assert test_acc[-1] >= 0.8 and test_acc[-1] >= test_acc[0]
assert len(starts) == len(ready) == niter and starts[:3] == [0, 1, 2]
print('ok')
