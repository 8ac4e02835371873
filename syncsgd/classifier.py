"""pycaffe's caffe.Classifier: a TEST net that takes (H, W, K) images, as caffe.io.load_image
gives them, and returns class scores, optionally averaged over ten crops."""
import numpy as np

from syncsgd import TEST
from syncsgd.io.images import oversample as ten_crops
from syncsgd.io.images import resize_image
from syncsgd.io.preprocess import Transformer
from syncsgd.net import Net


def configured_transformer(net, mean, input_scale, raw_scale, channel_swap):
    """A Transformer for the net's first input with pycaffe's HWK -> KHW transpose and the
    given preprocessing (None leaves a step out)."""
    in_ = net.inputs[0]
    transformer = Transformer({in_: net.blobs[in_].data.shape})
    transformer.set_transpose(in_, (2, 0, 1))
    if mean is not None:
        transformer.set_mean(in_, mean)
    if input_scale is not None:
        transformer.set_input_scale(in_, input_scale)
    if raw_scale is not None:
        transformer.set_raw_scale(in_, raw_scale)
    if channel_swap is not None:
        transformer.set_channel_swap(in_, channel_swap)
    return transformer


class Classifier(Net):
    def __init__(self, model_file, pretrained_file, image_dims=None, mean=None,
                 input_scale=None, raw_scale=None, channel_swap=None):
        super().__init__(model_file, pretrained_file, TEST)
        self.transformer = configured_transformer(self, mean, input_scale, raw_scale,
                                                  channel_swap)
        self.crop_dims = np.array(self.blobs[self.inputs[0]].data.shape[2:])
        self.image_dims = np.array(image_dims if image_dims is not None else self.crop_dims)

    def predict(self, inputs, oversample=True):
        """Scores (len(inputs), classes): images resized to image_dims, then the ten-crop mean
        (oversample) or the centre crop of the input's size."""
        h, w = (int(d) for d in self.image_dims)
        images = np.stack([resize_image(im, (h, w)) for im in inputs])
        if oversample:
            images = ten_crops(images, self.crop_dims)
        else:
            ch, cw = (int(d) for d in self.crop_dims)
            y, x = int(h / 2.0 - ch / 2.0), int(w / 2.0 - cw / 2.0)
            images = images[:, y:y + ch, x:x + cw]
        in_ = self.inputs[0]
        caffe_in = np.stack([self.transformer.preprocess(in_, im) for im in images])
        predictions = self.forward_all(**{in_: caffe_in})[self.outputs[0]]
        if oversample:
            predictions = predictions.reshape(len(predictions) // 10, 10, -1).mean(axis=1)
        return predictions
