"""Deconvolution: the transpose of Convolution (its forward is convolution's backward to the data),
with the weights (bottom channels, num_output / group, kh, kw) as in Caffe."""
from syncsgd.layers.convolution import ConvolutionBase
from syncsgd.kernels.im2col import deconv_out_size
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
            def work(n0, n1, _):
                cols = self._im2col.columns(n1 - n0)
                self._weights_transposed_times(self._pairs(bot.data[n0:n1], cols), cols)
                self._im2col.col2im(cols, t.data[n0:n1])
            self._for_chunks(work, shared=not self._per_sample)
            self._add_bias(t.data)

    def backward(self, top, propagate_down, bottom):
        for b, (t, bot) in enumerate(zip(top, bottom)):
            self._accumulate_bias_grad(t.diff)

            def work(n0, n1, diff):
                cols = self._im2col.im2col(t.diff[n0:n1])
                self._accumulate_weight_grad(self._pairs(bot.data[n0:n1], cols), diff)
                if propagate_down[b]:
                    self._weights_times(cols, bot.diff[n0:n1], add_bias=False)
            self._for_chunks(work, gradient=True)
