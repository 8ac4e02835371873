"""Nets written in Python, as pycaffe's net_spec: `caffe.layers` (here `syncsgd.layers`),
`caffe.params` and `caffe.NetSpec`, so scripts that generate prototxt run unchanged.

    n = NetSpec()
    n.data, n.label = L.Data(source="train_lmdb", backend=P.Data.LMDB, batch_size=64, ntop=2)
    n.ip = L.InnerProduct(n.data, num_output=10, weight_filler=dict(type="xavier"))
    n.loss = L.SoftmaxWithLoss(n.ip, n.label)
    text = str(n.to_proto())

A keyword argument is a field of the type's own `*_param` message when that has one of the name,
else a field of LayerParameter; dicts become sub-messages and lists repeated fields.
"""
from collections import Counter, OrderedDict

from syncsgd.proto import pb


def param_name_dict():
    """Layer type -> the prefix of its *_param field (Convolution -> convolution), from the schema:
    the parameter message's name less "Parameter" names the type. Unlike pycaffe, Deconvolution
    and Im2col keywords also go to convolution_param (pycaffe needs convolution_param=dict(...))."""
    layer = pb.LayerParameter()
    names = {}
    for field in layer.DESCRIPTOR.fields:
        if field.name.endswith("_param") and field.message_type is not None:
            type_name = field.message_type.name[:-len("Parameter")]
            names[type_name] = field.name[:-len("_param")]
    # Types whose parameters live in another type's message.
    names.update(Deconvolution="convolution", Im2col="convolution",
                 ConvolutionDepthwise="convolution")
    return names


_PARAM_NAMES = param_name_dict()


def assign_proto(proto, name, value):
    """Set field `name` of message `proto` from a Python value: a dict fills a sub-message, a list
    of dicts adds repeated sub-messages, a list (or a lone value, for a repeated field) extends a
    repeated field."""
    field = getattr(proto, name)
    if hasattr(field, "extend") and not isinstance(value, (list, tuple)):
        value = [value]
    if isinstance(value, (list, tuple)):
        if value and isinstance(value[0], dict):
            for item in value:
                sub = field.add()
                for k, v in item.items():
                    assign_proto(sub, k, v)
        else:
            field.extend(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            assign_proto(field, k, v)
    else:
        setattr(proto, name, value)


class Top:
    """One output of a Function: what NetSpec attributes and layer inputs hold."""

    def __init__(self, fn, n):
        self.fn = fn
        self.n = n

    def to_proto(self):
        """A NetParameter with every layer this top depends on."""
        return to_proto(self)

    def _to_proto(self, layers, names, autonames):
        return self.fn._to_proto(layers, names, autonames)


class Function:
    """A layer not yet written out: its type, input tops and keyword parameters."""

    def __init__(self, type_name, inputs, params):
        self.type_name = type_name
        for i, top in enumerate(inputs):
            if not isinstance(top, Top):
                raise TypeError(f"{type_name} input {i} is not a Top (type is {type(top)})")
        self.inputs = inputs
        self.params = dict(params)
        self.ntop = self.params.pop("ntop", 1)
        self.in_place = self.params.pop("in_place", False)
        if self.in_place and len(inputs) != 1:
            raise ValueError(f"{type_name}: in_place=True needs exactly one input")
        self.tops = tuple(Top(self, n) for n in range(self.ntop))

    def _get_name(self, names, autonames):
        if self not in names and self.ntop > 0:
            names[self] = self._get_top_name(self.tops[0], names, autonames)
        elif self not in names:
            autonames[self.type_name] += 1
            names[self] = self.type_name + str(autonames[self.type_name])
        return names[self]

    def _get_top_name(self, top, names, autonames):
        if top not in names:
            autonames[top.fn.type_name] += 1
            names[top] = top.fn.type_name + str(autonames[top.fn.type_name])
        return names[top]

    def _to_proto(self, layers, names, autonames):
        if self in layers:
            return
        bottom_names = []
        for top in self.inputs:
            top._to_proto(layers, names, autonames)
            bottom_names.append(layers[top.fn].top[top.n])
        layer = pb.LayerParameter()
        layer.type = self.type_name
        layer.bottom.extend(bottom_names)
        if self.in_place:
            layer.top.extend(layer.bottom)
        else:
            layer.top.extend(self._get_top_name(top, names, autonames) for top in self.tops)
        layer.name = self._get_name(names, autonames)
        own = _PARAM_NAMES.get(self.type_name)
        for key, value in self.params.items():
            # The type's own *_param message first, then LayerParameter, as pycaffe does.
            target = layer
            if not key.endswith("param") and own is not None and \
                    key in getattr(layer, f"{own}_param").DESCRIPTOR.fields_by_name:
                target = getattr(layer, f"{own}_param")
            elif not key.endswith("param") and key not in layer.DESCRIPTOR.fields_by_name:
                raise AttributeError(f"{self.type_name}: neither LayerParameter nor "
                                     f"{own or self.type_name.lower()}_param has a field "
                                     f"'{key}'")
            assign_proto(target, key, value)
        layers[self] = layer


class NetSpec:
    """Tops assigned as attributes, in order; to_proto() names each layer after its attribute."""

    def __init__(self):
        super().__setattr__("tops", OrderedDict())

    def __setattr__(self, name, value):
        self.tops[name] = value

    def __getattr__(self, name):
        try:
            return self.tops[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setitem__(self, key, value):
        self.__setattr__(key, value)

    def __getitem__(self, item):
        return self.__getattr__(item)

    def __delitem__(self, name):
        del self.tops[name]

    def keys(self):
        return list(self.tops.keys())

    def vals(self):
        return list(self.tops.values())

    def to_proto(self):
        names = {v: k for k, v in self.tops.items()}
        autonames = Counter()
        layers = OrderedDict()
        for top in self.tops.values():
            top._to_proto(layers, names, autonames)
        net = pb.NetParameter()
        net.layer.extend(layers.values())
        return net


def to_proto(*tops):
    """A NetParameter of the layers the given tops depend on, automatically named."""
    layers = OrderedDict()
    autonames = Counter()
    for top in tops:
        top.fn._to_proto(layers, {}, autonames)
    net = pb.NetParameter()
    net.layer.extend(layers.values())
    return net


class Layers:
    """`L.Type(*bottoms, **params)` makes a layer of Caffe type `Type`; it returns its top (or a
    tuple of tops with ntop > 1, the Function itself with ntop=0)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)

        def layer_fn(*args, **kwargs):
            fn = Function(name, args, kwargs)
            if fn.ntop == 0:
                return fn
            if fn.ntop == 1:
                return fn.tops[0]
            return fn.tops
        return layer_fn


class Parameters:
    """`P.Pooling.MAX`: the enum values of each type's parameter message, by type name."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        message = getattr(pb, f"{name}Parameter", None)
        if message is None:
            raise AttributeError(f"no {name}Parameter message in the schema")

        class Param:
            def __getattr__(self, param_name):
                return getattr(message, param_name)
        return Param()


layers = Layers()
params = Parameters()
