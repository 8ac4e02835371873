"""pycaffe's caffe.io.Transformer: turns (H, W, K) float images, as load_image gives them, into
a net input's (K, H, W) layout and scale, and back.

preprocess runs, per input: resize to the input's spatial size, transpose, channel swap (RGB ->
BGR for nets trained with Caffe's OpenCV loader), raw scale ([0, 1] -> [0, 255]), mean
subtraction, input scale. deprocess undoes them in reverse order.
"""
import numpy as np

from syncsgd.io.images import resize_image


class Transformer:
    def __init__(self, inputs):
        """`inputs`: {input blob name: its shape (N, K, H, W)}, e.g. {'data': net.blobs['data']
        .data.shape}."""
        self.inputs = inputs
        self.transpose = {}
        self.channel_swap = {}
        self.raw_scale = {}
        self.mean = {}
        self.input_scale = {}

    def _check_input(self, in_):
        if in_ not in self.inputs:
            raise ValueError(f"{in_} is not one of the net inputs: {self.inputs}")

    def preprocess(self, in_, data):
        """(H, W, K) image -> (K, H, W) float32 net input."""
        self._check_input(in_)
        caffe_in = np.asarray(data).astype(np.float32, copy=False)
        in_dims = tuple(self.inputs[in_][2:])
        if caffe_in.shape[:2] != in_dims:
            caffe_in = resize_image(caffe_in, in_dims)
        transpose = self.transpose.get(in_)
        if transpose is not None:
            caffe_in = caffe_in.transpose(transpose)
        channel_swap = self.channel_swap.get(in_)
        if channel_swap is not None:
            caffe_in = caffe_in[list(channel_swap), :, :]
        caffe_in = np.array(caffe_in, np.float32)     # own the values before scaling in place
        if self.raw_scale.get(in_) is not None:
            caffe_in *= self.raw_scale[in_]
        if self.mean.get(in_) is not None:
            caffe_in -= self.mean[in_]
        if self.input_scale.get(in_) is not None:
            caffe_in *= self.input_scale[in_]
        return caffe_in

    def deprocess(self, in_, data):
        """A net input (or its (1, K, H, W) batch) -> the (H, W, K) image preprocess took."""
        self._check_input(in_)
        decaf_in = np.array(data, np.float32).squeeze()
        if self.input_scale.get(in_) is not None:
            decaf_in /= self.input_scale[in_]
        if self.mean.get(in_) is not None:
            decaf_in += self.mean[in_]
        if self.raw_scale.get(in_) is not None:
            decaf_in /= self.raw_scale[in_]
        channel_swap = self.channel_swap.get(in_)
        if channel_swap is not None:
            decaf_in = decaf_in[np.argsort(channel_swap), :, :]
        transpose = self.transpose.get(in_)
        if transpose is not None:
            decaf_in = decaf_in.transpose(np.argsort(transpose))
        return decaf_in

    def set_transpose(self, in_, order):
        """Axis order from the image's to the input's, e.g. (2, 0, 1) for HWK -> KHW."""
        self._check_input(in_)
        if len(order) != len(self.inputs[in_]) - 1:
            raise ValueError("Transpose order needs to have the same number of dimensions as "
                             "the input.")
        self.transpose[in_] = order

    def set_channel_swap(self, in_, order):
        """Channel order after transposing, e.g. (2, 1, 0) for RGB -> BGR."""
        self._check_input(in_)
        if len(order) != self.inputs[in_][1]:
            raise ValueError("Channel swap needs to have the same number of dimensions as the "
                             "input channels.")
        self.channel_swap[in_] = order

    def set_raw_scale(self, in_, scale):
        """Scale the raw image, e.g. 255 for models trained on [0, 255] pixels."""
        self._check_input(in_)
        self.raw_scale[in_] = scale

    def set_mean(self, in_, mean):
        """Subtract a per-channel mean (K,) or an elementwise mean (K, H, W) or (H, W)."""
        self._check_input(in_)
        mean = np.asarray(mean)
        if mean.ndim == 1:
            if mean.shape[0] != self.inputs[in_][1]:
                raise ValueError("Mean channels incompatible with input.")
            mean = mean[:, np.newaxis, np.newaxis]
        else:
            shape = mean.shape if mean.ndim != 2 else (1,) + mean.shape
            if len(shape) != 3:
                raise ValueError("Mean shape invalid")
            if tuple(shape) != tuple(self.inputs[in_][1:]):
                raise ValueError("Mean shape incompatible with input shape.")
        self.mean[in_] = mean

    def set_input_scale(self, in_, scale):
        """Scale after mean subtraction, e.g. 0.017 for nets trained on standardised input."""
        self._check_input(in_)
        self.input_scale[in_] = scale
