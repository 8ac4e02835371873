"""Split: hands one blob to several consumers; their gradients add up. In a form's layout
where the blobs hold forms (blob.py), as the convolutions of a ResNet's blocks leave them:
gradients in other layouts are reordered into the first one's. A plain ReLU in place before
it (a ResNet's, after the shortcut) may add them up instead, masking the sum in the same pass
(ReLU.absorb)."""
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
    passes_forms = True

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        self._gather = Gather()
        self._fusion = None         # with the ReLU before it, which then does the sums

    def absorbed_by(self, fusion):
        """Where fusion.backward, backward leaves the sum to the ReLU before this layer, saying
        in fusion.sums whether there is one to make (propagate_down)."""
        self._fusion = fusion

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
        if self._fusion is not None and self._fusion.backward:
            self._fusion.sums = propagate_down[0]
            return
        if propagate_down[0]:
            self.add_gradients(top, bottom)

    def add_gradients(self, top, bottom, mask=None):
        """bottom's diff = the sum of the tops' diffs; with `mask` (the bottom's values, an
        array), times (mask > 0), a plain ReLU's gradient."""
        if mask is not None:
            weighted_sum([t.diff for t in top], [1] * len(top), bottom[0].overwrite(1),
                         mask=mask)
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
