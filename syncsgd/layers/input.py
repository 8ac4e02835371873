"""Input: tops the user fills (net.forward(data=...)); input_param gives their initial shapes."""
from syncsgd.layers.base import Layer
from syncsgd.layers.registry import register


def shape_for(shapes, i):
    """One BlobShape for all tops, or one per top."""
    return tuple(shapes[0 if len(shapes) == 1 else i].dim)


@register
class Input(Layer):
    type = "Input"
    exact_bottoms = 0
    min_tops = 1

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        shapes = self.param.input_param.shape
        if len(shapes) not in (0, 1, len(top)):
            self.fail(f"{len(shapes)} input_param shapes for {len(top)} tops; give one shape "
                      f"for all tops or one per top")
        for i, t in enumerate(top):
            if shapes:
                t.reshape(shape_for(shapes, i))

    def reshape(self, bottom, top):
        """The user may have reshaped the tops since setup; keep their shapes."""

    def forward(self, bottom, top):
        pass
