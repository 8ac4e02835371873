"""syncsgd.coord_map as pycaffe's caffe.coord_map: maps through convolution, pooling and
deconvolution, and the Crop layer FCN's net scripts build with it."""
import numpy as np
import pytest

import syncsgd as caffe
from syncsgd import layers as L
from syncsgd import params as P
from syncsgd.coord_map import AxisMismatchException, compose, coord_map_from_to, crop


def fcn_like(ks=3, stride=1, pad=0, pool=2, dstride=2, dpad=0):
    n = caffe.NetSpec()
    n.data = L.Input(shape=dict(dim=[2, 1, 100, 100]))
    n.conv = L.Convolution(n.data, num_output=4, kernel_size=ks, stride=stride, pad=pad)
    n.pool = L.Pooling(n.conv, pool=P.Pooling.MAX, kernel_size=pool, stride=pool)
    n.deconv = L.Deconvolution(n.pool, num_output=4, kernel_size=2 * dstride, stride=dstride,
                               pad=dpad)
    return n


def test_pool_and_deconv_of_one_factor_map_back_to_the_input():
    n = fcn_like()
    ax, a, b = coord_map_from_to(n.deconv, n.data)
    assert ax == 1
    np.testing.assert_array_equal([a, b], [[1], [0]])
    n = fcn_like(pool=4, dstride=4)
    ax, a, b = coord_map_from_to(n.deconv, n.data)
    assert ax == 1
    np.testing.assert_array_equal([a, b], [[1], [-1]])


def test_padding_shifts_and_pointwise_layers_pass():
    n = fcn_like(pad=10)
    ax, a, b = coord_map_from_to(n.deconv, n.data)
    np.testing.assert_array_equal([a, b], [[1], [-10]])     # 10 pixels of padding to crop
    n.relu = L.ReLU(n.deconv)
    n.drop = L.Dropout(n.relu)
    ax2, a2, b2 = coord_map_from_to(n.drop, n.data)
    assert ax2 == ax
    np.testing.assert_array_equal([a2, b2], [a, b])


def test_rectangular_parameters_map_per_axis():
    n = fcn_like(ks=[3, 5], stride=[1, 2], pad=[0, 10])
    ax, a, b = coord_map_from_to(n.deconv, n.data)
    np.testing.assert_allclose(a, [1, 2])
    np.testing.assert_allclose(b, [0, -10])


def test_crop_of_crop_adds_offsets():
    n = fcn_like()
    ax, a, b = coord_map_from_to(n.deconv, n.data)
    n.crop = L.Crop(n.deconv, n.data, axis=2, offset=7)
    ax2, a2, b2 = coord_map_from_to(n.crop, n.data)
    assert ax2 == ax
    np.testing.assert_array_equal([a2, b2], [a, b + 7])


def test_crop_helper_writes_the_offset_the_geometry_implies():
    n = fcn_like(pad=10)
    n.score = crop(n.deconv, n.data)
    layer = n.to_proto().layer[-1]
    assert layer.type == "Crop" and list(layer.bottom) == ["deconv", "data"]
    assert layer.crop_param.axis == 2 and list(layer.crop_param.offset) == [10]
    with pytest.raises(AssertionError, match="scale mismatch"):
        crop(n.pool, n.data)
    with pytest.raises(AssertionError, match="negative offset"):
        crop(n.data, n.deconv)
    odd = fcn_like(ks=4, pad=2)
    with pytest.raises(AssertionError, match="noninteger"):
        crop(odd.conv, odd.data)


def test_unconnected_tops_and_mismatched_axes_are_errors():
    n = fcn_like()
    n.ip = L.InnerProduct(n.deconv, num_output=3)
    with pytest.raises(RuntimeError, match="Could not compute map"):
        coord_map_from_to(n.ip, n.data)
    with pytest.raises(AxisMismatchException):
        compose((1, 1, 0), (2, 1, 0))
