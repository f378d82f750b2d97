"""How a model family registers its entry points: one decorator per family, made by :func:`family_registrar`
from the family's metadata function and its architecture keyword arguments, so that every entry point of the
family is registered alike (:func:`~lambdanet.models.registry.register_model` under the function's name, with
the family's :class:`~lambdanet.models.registry.ModelInfo` and declared arguments)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypeVar, cast

from torch import nn

from lambdanet.models.registry import ModelInfo, register_model

__all__ = ["family_registrar"]

EntryPoint = TypeVar("EntryPoint", bound=Callable[..., nn.Module])


def family_registrar(
    info: Callable[[str], ModelInfo],
    args: Mapping[str, object],
    doc: Callable[[str], str] | None = None,
) -> Callable[[EntryPoint], EntryPoint]:
    """The decorator registering an entry point of a family: ``register_model(fn, info=info(name), args=args)``
    with ``name`` the function's name; ``doc(name)``, when given, becomes the function's docstring first.

    Args:
        info: the metadata of the family's model ``name`` (from the family's table of configurations).
        args: the architecture keyword arguments every entry point of the family accepts, with their defaults.
        doc: the docstring of the entry point ``name`` (``None``: the function's own is kept).
    """

    def register(fn: EntryPoint) -> EntryPoint:
        name = fn.__name__
        if doc is not None:
            fn.__doc__ = doc(name)
        return cast("EntryPoint", register_model(fn, info=info(name), args=args))

    return register
