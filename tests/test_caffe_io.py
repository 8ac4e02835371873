"""syncsgd.io as pycaffe's caffe.io: Transformer, image loading and resizing, oversampling, and the
BlobProto / Datum converters, checked against hand-computed values and OpenCV's resize."""
import numpy as np
import pytest

import syncsgd as caffe
from syncsgd.errors import DataError
from syncsgd.proto import caffe_pb2

cv2 = pytest.importorskip("cv2")
Image = pytest.importorskip("PIL.Image")


def image(h=6, w=5, seed=0):
    return np.random.default_rng(seed).random((h, w, 3)).astype(np.float32)


def test_transformer_preprocess_is_pycaffe_order_and_deprocess_undoes_it():
    im = image()
    t = caffe.io.Transformer({"data": (1, 3, 6, 5)})
    t.set_transpose("data", (2, 0, 1))
    t.set_channel_swap("data", (2, 1, 0))
    t.set_raw_scale("data", 255)
    mean = np.array([104.0, 117.0, 123.0])
    t.set_mean("data", mean)
    t.set_input_scale("data", 0.5)
    out = t.preprocess("data", im)
    expected = (im.transpose(2, 0, 1)[::-1] * 255 - mean[:, None, None]) * 0.5
    assert out.dtype == np.float32 and out.shape == (3, 6, 5)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(t.deprocess("data", out[None]), im, atol=1e-5)
    assert im.max() <= 1.0      # preprocess did not scale the caller's image in place


def test_transformer_resizes_to_the_input_and_takes_elementwise_means():
    t = caffe.io.Transformer({"data": (2, 3, 4, 4)})
    t.set_transpose("data", (2, 0, 1))
    mean = np.random.default_rng(1).random((3, 4, 4))
    t.set_mean("data", mean)
    out = t.preprocess("data", image(8, 8))
    assert out.shape == (3, 4, 4)
    resized = caffe.io.resize_image(image(8, 8), (4, 4))
    np.testing.assert_allclose(out, resized.transpose(2, 0, 1) - mean, atol=1e-6)


def test_transformer_rejects_what_pycaffe_rejects():
    t = caffe.io.Transformer({"data": (1, 3, 4, 4)})
    with pytest.raises(ValueError, match="not one of the net inputs"):
        t.set_raw_scale("image", 255)
    with pytest.raises(ValueError, match="Transpose order"):
        t.set_transpose("data", (1, 0))
    with pytest.raises(ValueError, match="Channel swap"):
        t.set_channel_swap("data", (1, 0))
    with pytest.raises(ValueError, match="Mean channels"):
        t.set_mean("data", np.zeros(4))
    with pytest.raises(ValueError, match="Mean shape incompatible"):
        t.set_mean("data", np.zeros((3, 5, 5)))


def test_load_image_color_grey_and_alpha(tmp_path):
    rng = np.random.default_rng(2)
    rgb = rng.integers(0, 256, (7, 9, 3), dtype=np.uint8)
    Image.fromarray(rgb).save(tmp_path / "rgb.png")
    Image.fromarray(rgb[:, :, 0]).save(tmp_path / "grey.png")
    Image.fromarray(np.dstack([rgb, np.full((7, 9), 7, np.uint8)])).save(tmp_path / "rgba.png")
    color = caffe.io.load_image(str(tmp_path / "rgb.png"))
    assert color.dtype == np.float32 and color.shape == (7, 9, 3)
    np.testing.assert_allclose(color, rgb / 255.0, atol=1e-6)
    np.testing.assert_allclose(caffe.io.load_image(str(tmp_path / "rgba.png")), rgb / 255.0,
                               atol=1e-6)
    grey_as_color = caffe.io.load_image(str(tmp_path / "grey.png"))
    assert grey_as_color.shape == (7, 9, 3)
    np.testing.assert_allclose(grey_as_color[:, :, 2], rgb[:, :, 0] / 255.0, atol=1e-6)
    grey = caffe.io.load_image(str(tmp_path / "rgb.png"), color=False)
    assert grey.shape == (7, 9, 1)
    weights = np.array([0.2125, 0.7154, 0.0721])
    np.testing.assert_allclose(grey[:, :, 0], (rgb / 255.0) @ weights, atol=1e-5)
    with pytest.raises(DataError, match="does not exist"):
        caffe.io.load_image(str(tmp_path / "missing.png"))


@pytest.mark.parametrize("shape,new", [((5, 7, 3), (9, 4)), ((12, 10, 1), (5, 17)),
                                       ((4, 4, 6), (8, 8))])
def test_bilinear_resize_equals_opencv(shape, new):
    im = np.random.default_rng(3).random(shape).astype(np.float32)
    ours = caffe.io.resize_image(im, new)
    theirs = cv2.resize(im, (new[1], new[0]), interpolation=cv2.INTER_LINEAR)
    theirs = theirs.reshape(new + (shape[2],))
    assert ours.shape == new + (shape[2],) and ours.dtype == np.float32
    np.testing.assert_allclose(ours, theirs, atol=1e-5)


def test_nearest_resize_and_constant_images():
    im = np.arange(4, dtype=np.float32).reshape(2, 2, 1)
    near = caffe.io.resize_image(im, (4, 4), interp_order=0)
    np.testing.assert_array_equal(near[:, :, 0], np.kron(im[:, :, 0], np.ones((2, 2))))
    flat = np.full((3, 3, 3), 0.25, np.float32)
    np.testing.assert_array_equal(caffe.io.resize_image(flat, (5, 2)), 0.25)
    with pytest.raises(ValueError, match="interp_order"):
        caffe.io.resize_image(flat, (5, 2), interp_order=3)


def test_oversample_corners_centre_and_mirrors():
    ims = [image(8, 10, seed) for seed in (4, 5)]
    crops = caffe.io.oversample(ims, (4, 6))
    assert crops.shape == (20, 4, 6, 3)
    for i, im in enumerate(ims):
        c = crops[10 * i:10 * i + 10]
        np.testing.assert_array_equal(c[0], im[:4, :6])
        np.testing.assert_array_equal(c[1], im[:4, 4:])
        np.testing.assert_array_equal(c[2], im[4:, :6])
        np.testing.assert_array_equal(c[3], im[4:, 4:])
        np.testing.assert_array_equal(c[4], im[2:6, 2:8])
        np.testing.assert_array_equal(c[5:], c[:5, :, ::-1])


def test_blobproto_round_trips_with_diff_and_legacy_shapes():
    a = np.random.default_rng(6).random((2, 3, 4)).astype(np.float32)
    d = -a
    blob = caffe.io.array_to_blobproto(a, d)
    assert list(blob.shape.dim) == [2, 3, 4]
    np.testing.assert_allclose(caffe.io.blobproto_to_array(blob), a, rtol=1e-6)
    np.testing.assert_allclose(caffe.io.blobproto_to_array(blob, return_diff=True), d,
                               rtol=1e-6)
    legacy = caffe_pb2.BlobProto(num=1, channels=2, height=3, width=4, data=list(range(24)))
    assert caffe.io.blobproto_to_array(legacy).shape == (1, 2, 3, 4)
    arrays = [a, np.ones(5)]
    again = caffe.io.blobprotovector_str_to_arraylist(
        caffe.io.arraylist_to_blobprotovector_str(arrays))
    assert [x.shape for x in again] == [(2, 3, 4), (5,)]
    np.testing.assert_allclose(again[0], a, rtol=1e-6)


def test_datum_round_trips_uint8_and_float():
    pixels = np.random.default_rng(7).integers(0, 256, (3, 4, 5), dtype=np.uint8)
    datum = caffe.io.array_to_datum(pixels, label=7)
    assert (datum.channels, datum.height, datum.width, datum.label) == (3, 4, 5, 7)
    assert len(datum.data) == 60 and not len(datum.float_data)
    np.testing.assert_array_equal(caffe.io.datum_to_array(datum), pixels)
    values = np.random.default_rng(8).random((2, 2, 2))
    back = caffe.io.datum_to_array(caffe.io.array_to_datum(values))
    np.testing.assert_allclose(back, values)
    with pytest.raises(ValueError, match="Incorrect array shape"):
        caffe.io.array_to_datum(np.zeros((2, 2)))
