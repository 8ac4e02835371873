"""pycaffe's caffe.Detector: R-CNN-style scoring of image windows, each cropped (with optional
context padding filled with the mean), warped to the net's input and classified.

Windows are (ymin, xmin, ymax, xmax) in pixels of the image, as pycaffe takes them. Selective
search proposals (detect_selective_search) need the external selective_search_ijcv_with_python
module, as in pycaffe.
"""
import numpy as np

from syncsgd import TEST
from syncsgd.classifier import configured_transformer
from syncsgd.io.images import load_image, resize_image
from syncsgd.net import Net


class Detector(Net):
    def __init__(self, model_file, pretrained_file, mean=None, input_scale=None,
                 raw_scale=None, channel_swap=None, context_pad=None):
        super().__init__(model_file, pretrained_file, TEST)
        self.transformer = configured_transformer(self, mean, input_scale, raw_scale,
                                                  channel_swap)
        self.configure_crop(context_pad)

    def detect_windows(self, images_windows):
        """[(image file, [window, ...]), ...] -> one dict per window: window, prediction,
        filename."""
        crops = []
        for filename, windows in images_windows:
            image = load_image(filename)
            crops += [self.crop(image, window) for window in windows]
        in_ = self.inputs[0]
        caffe_in = np.stack([self.transformer.preprocess(in_, c) for c in crops])
        predictions = self.forward_all(**{in_: caffe_in})[self.outputs[0]]
        found = [(filename, window) for filename, windows in images_windows
                 for window in windows]
        return [{"window": window, "prediction": prediction, "filename": filename}
                for (filename, window), prediction in zip(found, predictions)]

    def detect_selective_search(self, image_fnames):
        """Windows proposed by selective search, then detect_windows."""
        try:
            import selective_search_ijcv_with_python as selective_search
        except ImportError:
            raise ImportError("detect_selective_search needs the selective_search_ijcv_with_"
                              "python module (as pycaffe's does); or give windows to "
                              "detect_windows") from None
        image_fnames = [str(f) for f in image_fnames]
        windows_list = selective_search.get_windows(image_fnames, cmd="selective_search_rcnn")
        return self.detect_windows(zip(image_fnames, windows_list))

    def crop(self, im, window):
        """The window's pixels; with context_pad, the window grown so that the padding is
        context_pad pixels at the net's input size, out-of-image parts filled with the mean."""
        window = np.asarray(window)
        if not self.context_pad:
            return im[int(window[0]):int(window[2]), int(window[1]):int(window[3])]
        size = int(self.crop_dims[0])
        scale = size / (1.0 * size - self.context_pad * 2)
        half_h = (window[2] - window[0] + 1) / 2.0
        half_w = (window[3] - window[1] + 1) / 2.0
        centre = (window[0] + half_h, window[1] + half_w)
        box = np.round(np.tile(centre, 2) + scale * np.array((-half_h, -half_w, half_h, half_w)))
        scale_h = size / (box[2] - box[0] + 1)
        scale_w = size / (box[3] - box[1] + 1)
        pad_y = int(round(max(0, -box[0]) * scale_h))      # how far the box leaves the image
        pad_x = int(round(max(0, -box[1]) * scale_w))
        im_h, im_w = im.shape[:2]
        box = np.clip(box, 0.0, [im_h, im_w, im_h, im_w]).astype(int)
        crop_h = min(int(round((box[2] - box[0] + 1) * scale_h)), size - pad_y)
        crop_w = min(int(round((box[3] - box[1] + 1) * scale_w)), size - pad_x)
        context = resize_image(im[box[0]:box[2], box[1]:box[3]], (crop_h, crop_w))
        out = np.ones(self.crop_dims, np.float32) * self.crop_mean
        out[pad_y:pad_y + crop_h, pad_x:pad_x + crop_w] = context
        return out

    def configure_crop(self, context_pad):
        """Crop size (H, W, K) from the net's input, and the mean in raw image space for
        padding."""
        in_ = self.inputs[0]
        transpose = self.transformer.transpose[in_]
        inverse = np.argsort(transpose)
        self.crop_dims = np.array(self.blobs[in_].data.shape[1:])[inverse]
        self.context_pad = context_pad
        self.crop_mean = np.zeros(self.crop_dims, np.float32)
        mean = self.transformer.mean.get(in_)
        if context_pad and mean is not None:
            crop_mean = np.broadcast_to(mean, self.blobs[in_].data.shape[1:]).transpose(inverse)
            crop_mean = np.array(crop_mean, np.float32)
            swap = self.transformer.channel_swap.get(in_)
            if swap is not None:
                crop_mean = crop_mean[:, :, np.argsort(swap)]
            raw_scale = self.transformer.raw_scale.get(in_)
            if raw_scale is not None:
                crop_mean /= raw_scale
            self.crop_mean = crop_mean
