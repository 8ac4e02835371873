"""Split: hands one blob to several consumers; their gradients add up. In a form's layout
where the blobs hold forms (blob.py), as the convolutions of a ResNet's blocks leave them:
gradients in other layouts are reordered into the first one's."""
import numpy as np

from syncsgd.kernels.elementwise import scaled_copies, weighted_sum
from syncsgd.kernels.onednn import Gather, form_like
from syncsgd.layers.base import Layer
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
        # The tops hold the bottom's values, as Caffe's ShareData, where no consumer runs in
        # place on one (tops_read_only, set by the net); else copies, so that a consumer working
        # in place does not change its siblings.
        x = bottom[0]
        form = x.form(0)
        ones = [1] * len(top)
        if form is not None and all(t.takes_forms for t in top):
            if self.tops_read_only:
                for t in top:
                    if t.array(0) is x.array(0):       # shared before: its own array again
                        t.data = np.zeros_like(t.array(0))
                    t.keep(0, form)
                return
            outs = [form_like(t, 0, form) for t in top]
            scaled_copies(form.values, ones, [out.values for out in outs])
            for t, out in zip(top, outs):
                t.keep(0, out)
            return
        copies = [t for t in top if not (self.tops_read_only and t.share_data(x))]
        scaled_copies(x.data, ones[:len(copies)], [t.overwrite(0) for t in copies])

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        # The sum goes in a form only where the bottom's values are in one: its producer's
        # backward then reads the gradient in that layout, not reordered back to an array.
        in_forms = bottom[0].takes_forms and bottom[0].form(0) is not None
        like, values = self._gather.values(top, 1) if in_forms else (None, None)
        if like is not None:
            out = form_like(bottom[0], 1, like)
            weighted_sum(values, [1] * len(values), out.values)
            bottom[0].keep(1, out)
            return
        weighted_sum([t.diff for t in top], [1] * len(top), bottom[0].overwrite(1))
