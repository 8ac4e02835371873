"""Deconvolution: the transpose of Convolution (its forward is convolution's backward to the data),
with the weights (bottom channels, num_output / group, kh, kw) as in Caffe."""
from syncsgd.layers.convolution import ConvolutionBase
from syncsgd.layers.im2col import deconv_out_size
from syncsgd.layers.registry import register


@register
class DeconvolutionLayer(ConvolutionBase):
    type = "Deconvolution"
    reverse = True

    def _top_size(self, bottom_size):
        return tuple(deconv_out_size(*a) for a in zip(bottom_size, self.kernel, self.pad,
                                                       self.stride, self.dilation))

    def forward(self, bottom, top):
        for bot, t in zip(bottom, top):
            for n0, n1 in self._chunks():
                self._features_to_image(self._features_in(bot.data[n0:n1]), t.data[n0:n1])
            self._add_bias(t.data)

    def backward(self, top, propagate_down, bottom):
        for b, (t, bot) in enumerate(zip(top, bottom)):
            self._accumulate_bias_grad(t.diff)
            for n0, n1 in self._chunks():
                cols = self._columns(t.diff[n0:n1])
                self._accumulate_weight_grad(self._features_in(bot.data[n0:n1]), cols)
                if propagate_down[b]:
                    self._weights_times(cols, n1 - n0)
                    self._features_out(n1 - n0, bot.diff[n0:n1])
