"""Deconvolution: the transpose of Convolution (its forward is convolution's backward to the data),
with the weights (bottom channels, num_output / group, *kernel) as in Caffe, over any number of
spatial axes as Convolution; always on the GEMM kernels over columns (its plan's "columns")."""
from syncsgd.kernels.im2col import deconv_out_size
from syncsgd.layers.convolution import ConvolutionBase
from syncsgd.layers.registry import register


@register
class DeconvolutionLayer(ConvolutionBase):
    type = "Deconvolution"
    reverse = True

    def _top_size(self, bottom_size):
        return tuple(deconv_out_size(*a) for a in zip(bottom_size, self.kernel, self.pad,
                                                       self.stride, self.dilation))

    def forward(self, bottom, top):
        kernel = self._kernels["columns"]
        weights = kernel.weight_matrix(self.blobs[0].data)
        for bot, t in zip(bottom, top):
            maps, images = bot.data.reshape(self._bottom_batch), t.data.reshape(self._top_batch)

            def work(n0, n1, _):
                pairs, cols = kernel.carry(maps[n0:n1])
                kernel.weights_transposed_times(weights, pairs, cols)
                kernel.layout.col2im(cols, images[n0:n1])
            self._for_chunks(work, shared=self.plan.shared_forward)
            self._add_bias(images)

    def backward(self, top, propagate_down, bottom):
        kernel = self._kernels["columns"]
        weights = kernel.weight_matrix(self.blobs[0].data)
        for b, (t, bot) in enumerate(zip(top, bottom)):
            images_diff = t.diff.reshape(self._top_batch)
            maps, maps_diff = (a.reshape(self._bottom_batch) for a in (bot.data, bot.diff))
            self._accumulate_bias_grad(images_diff)

            def work(n0, n1, diff):
                cols = kernel.layout.im2col(images_diff[n0:n1])
                kernel.accumulate_weight_grad(kernel.pairs(maps[n0:n1], cols), diff)
                if propagate_down[b]:
                    kernel.weights_times(weights, None, cols, maps_diff[n0:n1])
            self._for_chunks(work, gradient=kernel)
