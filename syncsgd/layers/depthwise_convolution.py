"""DepthwiseConvolution (yonghenglh6/DepthwiseConvolution, used by MobileNet ports): the fork's
GPU kernel convolves channel c with filter c alone, its CPU path runs Caffe's grouped
convolution; both agree when convolution_param.group is the bottom's channel count, which the
fork's conversion script leaves in place and this layer requires."""
from syncsgd.layers.convolution import spatial_axes
from syncsgd.layers.convolution_depthwise import ConvolutionDepthwiseLayer
from syncsgd.layers.registry import register


@register
class DepthwiseConvolutionLayer(ConvolutionDepthwiseLayer):
    type = "DepthwiseConvolution"
    fork = "yonghenglh6/DepthwiseConvolution"

    def setup(self, bottom, top):
        if bottom:
            p = self.param.convolution_param
            axis, _ = spatial_axes(self, p, bottom[0])
            channels = bottom[0].shape[axis]
            if p.group != channels:
                self.fail(f"convolution_param.group is {p.group} but the bottom has {channels} "
                          f"channels: set group: {channels} (or use type Convolution for a "
                          f"grouped convolution)")
        super().setup(bottom, top)
