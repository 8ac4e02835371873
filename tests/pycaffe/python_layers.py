"""Python layers, as Caffe's pyloss example and the multilabel data-layer notebook use them: a
loss written in Python gives the built-in EuclideanLoss's value and gradients, and a Python data
layer feeds a net that a solver trains."""
import numpy as np

import syncsgd as caffe

x = np.random.default_rng(0).standard_normal((10, 9, 8)).astype(np.float32)
y = np.random.default_rng(1).standard_normal((10, 9, 8)).astype(np.float32)
for kind, python in (('builtin', False), ('python', True)):
    layer = ("type: 'Python' python_param { module: 'pylayers' layer: 'EuclideanLossLayer' }"
             if python else "type: 'EuclideanLoss'")
    with open(kind + '.prototxt', 'w') as f:
        f.write("""name: '%s' force_backward: true
layer { name: 'in' type: 'Input' top: 'x' top: 'y'
  input_param { shape { dim: 10 dim: 9 dim: 8 } shape { dim: 10 dim: 9 dim: 8 } } }
layer { name: 'loss' bottom: 'x' bottom: 'y' top: 'loss' loss_weight: 1 %s }
""" % (kind, layer))
    net = caffe.Net(kind + '.prototxt', caffe.TRAIN)
    net.blobs['x'].data[...] = x
    net.blobs['y'].data[...] = y
    net.forward()
    net.backward()
    if not python:
        expected = (net.blobs['loss'].data.item(), net.blobs['x'].diff.copy(),
                    net.blobs['y'].diff.copy())
assert np.isclose(net.blobs['loss'].data.item(), expected[0], rtol=1e-5)
assert np.allclose(net.blobs['x'].diff, expected[1], atol=1e-6)
assert np.allclose(net.blobs['y'].diff, expected[2], atol=1e-6)

with open('pydata_train.prototxt', 'w') as f:
    f.write("""name: 'pydata'
layer { name: 'data' type: 'Python' top: 'data' top: 'label'
  python_param { module: 'pylayers' layer: 'DigitsDataLayer' param_str: '{"batch_size": 50}' } }
layer { name: 'ip1' type: 'InnerProduct' bottom: 'data' top: 'ip1'
  inner_product_param { num_output: 64 weight_filler { type: 'xavier' } } }
layer { name: 'relu' type: 'ReLU' bottom: 'ip1' top: 'ip1' }
layer { name: 'ip2' type: 'InnerProduct' bottom: 'ip1' top: 'ip2'
  inner_product_param { num_output: 10 weight_filler { type: 'xavier' } } }
layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'ip2' bottom: 'label' top: 'loss' }
""")
with open('pydata_solver.prototxt', 'w') as f:
    f.write('net: "pydata_train.prototxt"\nbase_lr: 0.1\nmomentum: 0.9\nlr_policy: "fixed"\n'
            'max_iter: 100\nrandom_seed: 5\nsnapshot_prefix: "pydata"\n')
solver = caffe.get_solver('pydata_solver.prototxt')
assert solver.net.layers[0].batch_size == 50     # the Python layer object is reachable
solver.net.forward()
first = solver.net.blobs['loss'].data.item()
solver.step(60)
last = np.mean([solver.net.forward()['loss'].item() for _ in range(3)])
print('loss', first, '->', last)
assert last < 0.5 * first
print('ok')
