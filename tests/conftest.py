"""Fixtures shared by several test files."""
import pytest

from syncsgd import TRAIN
from syncsgd.blob import Blob
from tests.gradcheck import make_layer


@pytest.fixture
def layer_factory():
    """Set-up data layers from LayerParameter text, as rank `rank` of `size`; all are closed at
    the end of the test (their prefetch threads stop)."""
    made = []

    def make(text, rank=0, size=1, phase=TRAIN, seed=1701, tops=("data", "label")):
        layer = make_layer(text, phase, seed)
        layer.ctx.rank, layer.ctx.size = rank, size
        top = [Blob(name=t) for t in tops]
        layer.setup([], top)
        layer.reshape([], top)
        made.append(layer)
        return layer, top

    yield make
    for layer in made:
        layer.close()
