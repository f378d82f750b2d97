"""torch.hub entry points: every registered lambdanet model, e.g.
``torch.hub.load("<owner>/lambdanet", "lambda_resnet26t", pretrained=True)`` (or a local clone with
``source="local"``); keyword arguments go to :func:`lambdanet.create_model`."""

from lambdanet import create_model as _create_model
from lambdanet import list_models as _list_models

dependencies = ["torch", "torchvision", "safetensors", "huggingface_hub", "yaml", "tqdm"]


def _entry(name: str):
    def entry(**kwargs):
        return _create_model(name, **kwargs)

    entry.__name__ = entry.__qualname__ = name
    entry.__doc__ = f"lambdanet's {name}: create_model({name!r}, **kwargs) (pretrained=True where weights exist)."
    return entry


globals().update({_name: _entry(_name) for _name in _list_models()})
