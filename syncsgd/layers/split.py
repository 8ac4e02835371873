"""Split: hands one blob to several consumers; their gradients add up. In a form's layout
where the blobs hold forms (blob.py), as the convolutions of a ResNet's blocks leave them:
gradients in other layouts are reordered into the first one's."""
import numpy as np

from syncsgd.kernels.onednn import Gather, form_like
from syncsgd.layers.base import Layer
from syncsgd.layers.eltwise import weighted_sum
from syncsgd.layers.registry import register


@register
class Split(Layer):
    type = "Split"
    exact_bottoms = 1
    min_tops = 1
    feature_local = True
    sample_wise = True
    takes_forms = True

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        self._gather = Gather()

    def reshape(self, bottom, top):
        for t in top:
            t.reshape_like(bottom[0])

    def forward(self, bottom, top):
        # Copies, not shared arrays: a consumer working in place must not change its siblings.
        form = bottom[0].form(0)
        if form is not None and all(t.takes_forms for t in top):
            for t in top:
                out = form_like(t, 0, form)
                np.copyto(out.values, form.values)
                t.keep(0, out)
            return
        for t in top:
            np.copyto(t.data, bottom[0].data)

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        like, values = self._gather.values(top, 1) if bottom[0].takes_forms else (None, None)
        if like is not None:
            out = form_like(bottom[0], 1, like)
            weighted_sum(values, [1] * len(values), out.values)
            bottom[0].keep(1, out)
            return
        dx = bottom[0].diff
        np.copyto(dx, top[0].diff)
        for t in top[1:]:
            np.add(dx, t.diff, out=dx)
