"""Net surgery, written as Caffe's net_surgery notebook does it: designer filters set by hand in
a convolution's params, and a classifier cast into a fully convolutional net by transplanting
its InnerProduct weights into convolutions, so it scores every 28x28 window of a larger image.

Usage: net_surgery.py WEIGHTS_DIR (holding lenet.prototxt and lenet_iter_10000.caffemodel)."""
import os
import sys

import numpy as np

import syncsgd as caffe
from digits import mnist_like

weights_dir = sys.argv[1]
model_def = os.path.join(weights_dir, 'lenet.prototxt')
model_weights = os.path.join(weights_dir, 'lenet_iter_10000.caffemodel')
caffe.set_mode_cpu()

# -- designer filters: one conv layer whose weights we write ourselves
with open('conv.prototxt', 'w') as f:
    f.write("""name: "convolution"
input: "data"
input_dim: 1 input_dim: 1 input_dim: 10 input_dim: 12
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 2 kernel_size: 3 stride: 1
    weight_filler { type: "gaussian" std: 0.01 } bias_filler { type: "constant" value: 0 } } }
""")
net = caffe.Net('conv.prototxt', caffe.TEST)
print('blobs {}\nparams {}'.format(net.blobs.keys(), net.params.keys()))
image = np.random.default_rng(0).random((10, 12)).astype(np.float32)
net.blobs['data'].data[...] = image
sobel = np.array([[-1, 0, 1], [-2, 0, 2], [-1, 0, 1]], np.float32)
net.params['conv'][0].data[0, 0] = sobel
net.params['conv'][0].data[1, 0] = sobel.T
net.params['conv'][1].data[...] = [0.0, 1.0]
net.forward()
windows = np.lib.stride_tricks.sliding_window_view(image, (3, 3))
expected = np.stack([(windows * sobel).sum(axis=(2, 3)), (windows * sobel.T).sum(axis=(2, 3)) + 1])
assert np.allclose(net.blobs['conv'].data[0], expected, atol=1e-5)

# -- casting the classifier into a fully convolutional net
net = caffe.Net(model_def, model_weights, caffe.TEST)
params = ['ip1', 'ip2']
fc_params = {pr: (net.params[pr][0].data, net.params[pr][1].data) for pr in params}
for fc in params:
    print('{} weights are {} dimensional and biases are {} dimensional'.format(
        fc, fc_params[fc][0].shape, fc_params[fc][1].shape))

with open(model_def) as f:
    text = f.read()
text = text.replace('dim: 64 dim: 1 dim: 28 dim: 28', 'dim: 1 dim: 1 dim: 36 dim: 36')
for name, kernel in (('ip1', 4), ('ip2', 1)):
    start = text.index('name: "%s"' % name)
    text = (text[:start] + text[start:].replace('type: "InnerProduct"', 'type: "Convolution"', 1)
            .replace('inner_product_param {', 'convolution_param {\n    kernel_size: %d' % kernel, 1)
            .replace('name: "%s"' % name, 'name: "%s-conv"' % name, 1))
with open('lenet_full_conv.prototxt', 'w') as f:
    f.write(text)
net_full_conv = caffe.Net('lenet_full_conv.prototxt', model_weights, caffe.TEST)
params_full_conv = ['ip1-conv', 'ip2-conv']
for pr, pr_conv in zip(params, params_full_conv):
    net_full_conv.params[pr_conv][0].data.flat = fc_params[pr][0].flat  # flat unrolls the arrays
    net_full_conv.params[pr_conv][1].data[...] = fc_params[pr][1]

digit = mnist_like(count=1)[0][0]
big = np.zeros((36, 36), np.float32)
big[4:32, 4:32] = digit               # the digit in the window at (4, 4): output cell (1, 1)
out = net_full_conv.forward(data=big[None, None])
scores = out['prob'][0]
assert scores.shape == (10, 3, 3), scores.shape
net.blobs['data'].reshape(1, 1, 28, 28)
net.reshape()
single = net.forward(data=big[None, None, 4:32, 4:32])['prob'][0]
assert np.allclose(scores[:, 1, 1], single, atol=1e-5)
print('classification map argmax', scores.argmax(axis=0).tolist())
print('ok')
