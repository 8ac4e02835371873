"""ConvolutionDepthwise (the depthwise layer of ShuffleNet's and MobileNet's Caffe forks): a
Convolution with one group per bottom channel, whatever convolution_param.group says."""
from syncsgd.layers.convolution import ConvolutionLayer, spatial_axes
from syncsgd.layers.registry import register
from syncsgd.proto import pb


@register
class ConvolutionDepthwiseLayer(ConvolutionLayer):
    type = "ConvolutionDepthwise"
    fork = "farmingyard/ShuffleNet"

    def setup(self, bottom, top):
        if bottom:
            axis, _ = spatial_axes(self, self.param.convolution_param, bottom[0])
            channels, outputs = bottom[0].shape[axis], self.param.convolution_param.num_output
            if channels and outputs % channels:
                self.fail(f"convolves each of the bottom's {channels} channels on its own: "
                          f"convolution_param.num_output {outputs} must be a multiple of "
                          f"{channels}")
            # A copy: the net's LayerParameter keeps what the file says.
            param = pb.LayerParameter()
            param.CopyFrom(self.param)
            param.convolution_param.group = channels
            self.param = param
        super().setup(bottom, top)
