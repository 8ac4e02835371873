"""pycaffe's coord_map: how spatial coordinates of one NetSpec top map onto another's, and the
Crop layer that aligns them (as FCN's scripts use it to crop upsampled scores onto the input).

A map is (axis, a, b): output coordinate x corresponds to input coordinate a * x + b along every
spatial axis from `axis` on; pointwise layers have the identity (None, 1, 0).
"""
import numpy as np

from syncsgd.net_spec import layers as L

# Layers whose output pixel i is computed from input pixel i.
PASS_THROUGH_LAYERS = ["AbsVal", "BatchNorm", "Bias", "BNLL", "Dropout", "Eltwise", "ELU", "Log",
                       "LRN", "Exp", "MVN", "Power", "ReLU", "PReLU", "Scale", "Sigmoid", "Split",
                       "TanH", "Threshold"]


class UndefinedMapException(Exception):
    """The layer type has no coordinate mapping (InnerProduct, Reshape, ...)."""


class AxisMismatchException(Exception):
    """Two composed maps act on different axes."""


def _given(fn, message):
    """The layer's parameters, whether given inside `message` (convolution_param=dict(...)) or
    as plain keywords."""
    return fn.params.get(message, fn.params)


def conv_params(fn):
    """(axis, stride, effective kernel extent, pad) of a Convolution, Deconvolution, Im2col or
    Pooling function, as arrays over the spatial axes."""
    params = _given(fn, "convolution_param" if fn.type_name != "Pooling" else "pooling_param")
    legacy = {"pad_h", "pad_w", "kernel_h", "kernel_w", "stride_h", "stride_w"} & set(params)
    if legacy:
        raise AssertionError(f"{fn.type_name}: cropping does not support the legacy _h/_w "
                             f"parameters ({', '.join(sorted(legacy))}); give kernel_size, "
                             "stride and pad per axis")
    kernel = np.array(params["kernel_size"], ndmin=1)
    dilation = np.array(params.get("dilation", 1), ndmin=1)
    return (params.get("axis", 1), np.array(params.get("stride", 1), ndmin=1),
            (kernel - 1) * dilation + 1, np.array(params.get("pad", 0), ndmin=1))


def crop_params(fn):
    """(axis, offsets) of a Crop function, with Caffe's defaults (axis 2: the spatial axes)."""
    params = _given(fn, "crop_param")
    return params.get("axis", 2), np.array(params.get("offset", 0), ndmin=1)


def coord_map(fn):
    """The map from the function's top coordinates to its (first) bottom's."""
    kind = fn.type_name
    if kind in ("Convolution", "Pooling", "Im2col"):
        axis, stride, extent, pad = conv_params(fn)
        return axis, 1 / stride, (pad - (extent - 1) / 2) / stride
    if kind == "Deconvolution":
        axis, stride, extent, pad = conv_params(fn)
        return axis, stride, (extent - 1) / 2 - pad
    if kind in PASS_THROUGH_LAYERS:
        return None, 1, 0
    if kind == "Crop":
        axis, offset = crop_params(fn)
        return axis - 1, 1, -offset     # the map's axis is the last one not cropped
    raise UndefinedMapException(kind)


def compose(base_map, next_map):
    """The map of applying `base_map`, then `next_map`."""
    ax1, a1, b1 = base_map
    ax2, a2, b2 = next_map
    if ax1 is not None and ax2 is not None and ax1 != ax2:
        raise AxisMismatchException(f"maps on axes {ax1} and {ax2} do not compose")
    return (ax2 if ax1 is None else ax1), a1 * a2, a1 * b2 + b1


def inverse(coord_map):
    ax, a, b = coord_map
    return ax, 1 / a, -b / a


def _bottoms(top):
    """The inputs a top's coordinates derive from (a Crop's second input only gives its size)."""
    inputs = top.fn.inputs
    return inputs[:1] if top.fn.type_name == "Crop" else inputs


def _walk_back(top):
    """(top, map from `top` to it) for `top` and each ancestor reached through mapped layers,
    nearest first."""
    maps = {top: (None, 1, 0)}
    frontier = [top]
    while frontier:
        current = frontier.pop()
        yield current, maps[current]
        try:
            step = coord_map(current.fn)
        except UndefinedMapException:
            continue
        for bottom in _bottoms(current):
            maps[bottom] = compose(maps[current], step)
            frontier.append(bottom)


def coord_map_from_to(top_from, top_to):
    """The map from `top_from`'s coordinates to `top_to`'s, through their common ancestor."""
    from_maps = dict(_walk_back(top_from))
    for top, to_map in _walk_back(top_to):
        if top in from_maps:
            return compose(to_map, inverse(from_maps[top]))
    raise RuntimeError("Could not compute map between tops; are they connected by spatial "
                       "layers?")


def crop(top_from, top_to):
    """A Crop layer cutting `top_from` to `top_to`'s extent at the offset the layers imply."""
    ax, a, b = coord_map_from_to(top_from, top_to)
    a, b = np.asarray(a), np.asarray(b)
    if not (a == 1).all():
        raise AssertionError(f"scale mismatch on crop (a = {a})")
    if not (b <= 0).all():
        raise AssertionError(f"cannot crop negative offset (b = {b})")
    if not (np.round(b) == b).all():
        raise AssertionError(f"cannot crop noninteger offset (b = {b})")
    return L.Crop(top_from, top_to,
                  crop_param=dict(axis=ax + 1, offset=list(-np.round(b).astype(int))))
