"""Classification with a trained net, written as Caffe's 00-classification notebook does it:
caffe.io.Transformer, load_image on image files, net.forward, then caffe.Classifier.

Usage: classify.py WEIGHTS_DIR (holding lenet.prototxt and lenet_iter_10000.caffemodel, a LeNet
trained on MNIST)."""
import os
import sys

import numpy as np

import syncsgd as caffe
from digits import mnist_like, write_png_files

weights_dir = sys.argv[1]
model_def = os.path.join(weights_dir, 'lenet.prototxt')
model_weights = os.path.join(weights_dir, 'lenet_iter_10000.caffemodel')

caffe.set_mode_cpu()
net = caffe.Net(model_def, model_weights, caffe.TEST)

images, labels = mnist_like(count=50)
files = write_png_files(images)

transformer = caffe.io.Transformer({'data': net.blobs['data'].data.shape})
transformer.set_transpose('data', (2, 0, 1))  # move image channels to outermost dimension

net.blobs['data'].reshape(len(files), 1, 28, 28)
for i, f in enumerate(files):
    image = caffe.io.load_image(f, color=False)
    net.blobs['data'].data[i] = transformer.preprocess('data', image)

output = net.forward()
predicted = output['prob'].argmax(axis=1)
accuracy = (predicted == labels).mean()
print('accuracy', accuracy)
assert accuracy >= 0.7, accuracy
assert np.allclose(output['prob'].sum(axis=1), 1, atol=1e-5)

# the same through caffe.Classifier, which batches with forward_all
classifier = caffe.Classifier(model_def, model_weights, image_dims=(28, 28))
scores = classifier.predict([caffe.io.load_image(f, color=False) for f in files],
                            oversample=False)
assert scores.shape == (len(files), 10)
assert (scores.argmax(axis=1) == predicted).all()
ten_crops = classifier.predict([caffe.io.load_image(files[0], color=False)])
assert ten_crops.shape == (1, 10) and abs(ten_crops.sum() - 1) < 1e-4
print('ok')
