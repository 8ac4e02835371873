"""Built-in versions of well-known public Python layers, for nets that name them in a Python
layer's python_param while their repository's code is not importable (OpenCV runs them the same
way). The user's own module, when importable, always wins (layers/python_layer.py)."""
import importlib

# (python_param.module, python_param.layer) -> (module here, class, where it comes from)
BUILTINS = {
    ("rpn.proposal_layer", "ProposalLayer"):
        ("proposal", "ProposalLayer", "rbgirshick/py-faster-rcnn lib/rpn/proposal_layer.py"),
}


def builtin(module, layer):
    """(class, origin) of the built-in for python_param (module, layer), or None."""
    entry = BUILTINS.get((module, layer))
    if entry is None:
        return None
    here, name, origin = entry
    return getattr(importlib.import_module(f"{__name__}.{here}"), name), origin
