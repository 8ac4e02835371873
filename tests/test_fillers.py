"""Each filler draws what Caffe's does: the right distribution, scale and shape rules."""
import numpy as np
import pytest
from google.protobuf import text_format

from syncsgd.errors import PrototxtError
from syncsgd.fillers import fill
from syncsgd.proto import pb


def draw(text, shape, seed=0):
    filler = text_format.Parse(text, pb.FillerParameter())
    array = np.zeros(shape, np.float32)
    return fill(array, filler, np.random.default_rng(seed))


def test_constant_and_uniform():
    assert (draw('type: "constant" value: 2.5', (3, 4)) == 2.5).all()
    u = draw('type: "uniform" min: -2 max: 3', (200, 100))
    assert u.min() >= -2 and u.max() < 3
    assert u.mean() == pytest.approx(0.5, abs=0.05)


def test_gaussian_and_sparse():
    g = draw('type: "gaussian" mean: 1 std: 0.5', (300, 100))
    assert g.mean() == pytest.approx(1, abs=0.01) and g.std() == pytest.approx(0.5, rel=0.02)
    s = draw('type: "gaussian" std: 1 sparse: 5', (50, 400))
    # Each weight is kept with probability sparse / num_outputs = 5 / 50.
    assert np.count_nonzero(s) / s.size == pytest.approx(0.1, abs=0.01)


@pytest.mark.parametrize("norm,n", [("FAN_IN", 3 * 5 * 5), ("FAN_OUT", 64 * 5 * 5),
                                    ("AVERAGE", (3 * 25 + 64 * 25) / 2)])
def test_xavier_and_msra_variance_norms(norm, n):
    shape = (64, 3, 5, 5)                  # fan_in = C*kh*kw, fan_out = num_output*kh*kw
    x = draw(f'type: "xavier" variance_norm: {norm}', shape)
    scale = np.sqrt(3.0 / n)
    assert np.abs(x).max() <= scale and np.abs(x).max() > 0.95 * scale
    m = draw(f'type: "msra" variance_norm: {norm}', shape)
    assert m.std() == pytest.approx(np.sqrt(2.0 / n), rel=0.05)


def test_positive_unitball_rows_sum_to_one():
    p = draw('type: "positive_unitball"', (7, 3, 2, 2))
    assert (p >= 0).all()
    np.testing.assert_allclose(p.reshape(7, -1).sum(1), 1, rtol=1e-6)


def test_bilinear_is_the_upsampling_kernel():
    b = draw('type: "bilinear"', (2, 1, 4, 4))
    # Caffe's kernel for factor 2: f = 2, c = 0.75; rows (0.25, 0.75, 0.75, 0.25).
    ramp = np.array([0.25, 0.75, 0.75, 0.25])
    np.testing.assert_allclose(b[1, 0], np.outer(ramp, ramp), rtol=1e-6)
    with pytest.raises(PrototxtError, match="square kernel"):
        draw('type: "bilinear"', (2, 1, 3, 4))


def test_seeded_and_unknown():
    a = draw('type: "gaussian"', (10,), seed=3)
    np.testing.assert_array_equal(a, draw('type: "gaussian"', (10,), seed=3))
    with pytest.raises(PrototxtError, match="unknown filler type 'gausian'"):
        draw('type: "gausian"', (2,))
