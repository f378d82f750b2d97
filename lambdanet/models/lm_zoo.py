"""The registered language models, ``<mixer>_lm_<size>`` (:class:`~lambdanet.models.lm.LanguageModel` of a size
of :data:`~lambdanet.models.lm.LM_SIZES`), and how :func:`~lambdanet.models.create_model` builds them
(:class:`LanguageModelAdapter`). Each takes its architecture options as keywords: ``vocab_size``, ``heads`` and
``mlp_ratio``; the lambda families also ``dim_k``, ``r``, ``dim_v``, ``dim_u``, ``chunk``, ``decay``,
``short_conv``, ``lambdas``, ``content``, ``key_norm``, ``query_softmax`` (the hybrid ``attention_every``); the
transformer ``positions`` and ``max_len``.

``lambda_lm_<size>`` runs a short causal convolution of width :data:`LAMBDA_SHORT_CONV` before its lambdas (the
best configuration of issue 37's ablation study, docs/language_models.md); ``plain_lambda_lm_<size>`` is the
paper's masked lambda layer alone, the default until 0.2.0. Runs write ``short_conv`` out since
(:func:`pin_lm_kwargs`), and a run written before reads back as the plain model it trained (:func:`saved_lm`)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, cast

from torch import nn

from lambdanet.models.lm import LM_SIZES, LanguageModel
from lambdanet.models.registry import ModelAdapter, ModelInfo, entry_point, register_model

if TYPE_CHECKING:
    from lambdanet.models.registry import CreatedModel

__all__ = ["LanguageModelAdapter", "LM_ADAPTER", "LAMBDA_SHORT_CONV", "LAMBDA_DEFAULTS", "pin_lm_kwargs", "saved_lm"]


def _lm(mixer: str, size: str, **kwargs) -> LanguageModel:
    s = LM_SIZES[size]
    return LanguageModel(mixer, s.dim, s.depth, **{**_size_args({}, size, mixer), **kwargs})


def _size_args(args: dict, size: str, mixer: str = "lambda") -> dict:
    """A family's architecture arguments with the size's own defaults: ``heads`` and ``mlp_ratio``, and for the
    lambda mixers ``dim_k`` and ``r`` (the ablations of docs/language_models.md vary them)."""
    s = LM_SIZES[size]
    own = {"heads": s.heads, "mlp_ratio": s.mlp_ratio}
    return {**args, **own, **({} if mixer == "transformer" else {"dim_k": s.dim_k, "r": s.r})}


_PAPER = "LambdaNetworks App. B.2 (masked lambdas) on sequences; baselines of the same size"
LAMBDA_ARGS = {"vocab_size": 256, "dim_v": None, "dim_u": 1, "chunk": 64, "dropout": 0.0, "decay": None,
               "short_conv": 0, "lambdas": 1, "content": True, "key_norm": "softmax",
               "query_softmax": False}  # fmt: skip
HYBRID_ARGS = {**LAMBDA_ARGS, "attention_every": 4}
LAMBDA_SHORT_CONV = 4  # lambda_lm_<size>'s short convolution: 1.1% lower bits per byte over 3 seeds (the study)
# what lambda_lm_<size> sets over plain_lambda_lm_<size>: the convolution, and at nano the value depth that keeps the
# parameters within 2% of the transformer's (the convolution's 4 x 480 weights per layer are 2.2% of nano's budget)
LAMBDA_DEFAULTS = {size: {"short_conv": LAMBDA_SHORT_CONV, **({"dim_v": 64} if size == "nano" else {})}
                   for size in LM_SIZES}  # fmt: skip
TRANSFORMER_ARGS = {"vocab_size": 256, "positions": "rotary", "max_len": None, "dropout": 0.0}
_DEFAULT_LAMBDA = re.compile(rf"lambda_lm_({'|'.join(LM_SIZES)})")


def pin_lm_kwargs(model: str, model_kwargs: Mapping) -> dict:
    """``model_kwargs`` as a run records them: with the options whose default moved written out (what a
    ``lambda_lm_<size>`` sets over the plain model, :data:`LAMBDA_DEFAULTS`), so the run stays the model it trained
    if a default moves again."""
    kwargs = dict(model_kwargs)
    if match := _DEFAULT_LAMBDA.fullmatch(model):
        kwargs = {**LAMBDA_DEFAULTS[match[1]], **kwargs}
    return kwargs


def saved_lm(model: str, model_kwargs: Mapping) -> tuple[str, dict]:
    """The registered model and options that a saved run's ``model`` and ``model_kwargs`` describe. A
    ``lambda_lm_<size>`` whose options lack ``short_conv`` was written before it became the default
    (:func:`pin_lm_kwargs` writes it out since): the plain lambda model, ``plain_lambda_lm_<size>``."""
    if _DEFAULT_LAMBDA.fullmatch(model) and "short_conv" not in model_kwargs:
        return f"plain_{model}", dict(model_kwargs)
    return model, dict(model_kwargs)


class LanguageModelAdapter(ModelAdapter):
    """How :func:`lambdanet.models.create_model` builds the language models: ``vocab_size`` (an architecture
    argument) instead of ``num_classes`` and ``in_chans``, no published or local weights (a trained model loads
    with :func:`lambdanet.tasks.lm.load_lm`), ``pretrained_cfg`` ``{"architecture", "vocab_size"}``."""

    def create(self, name, build, kwargs, *, num_classes, in_chans, pretrained, checkpoint_path) -> nn.Module:
        if num_classes is not None or in_chans is not None or pretrained or checkpoint_path is not None:
            raise ValueError(
                f"{name} is a language model: it takes vocab_size=..., not num_classes, in_chans or "
                "weights (load a trained one with lambdanet.tasks.lm.load_lm)"
            )
        return self._build(name, build, kwargs)

    def from_hub(self, repo, name, path, meta, kwargs, *, num_classes, in_chans) -> nn.Module:
        """The hub's ``vocab_size`` (``num_classes`` and ``in_chans`` do not apply); weights shared before
        ``lambda_lm_<size>``'s default moved build the plain model they are (:func:`saved_lm`)."""
        from safetensors.torch import load_model

        name = saved_lm(name, meta.get("model_kwargs", {}))[0]
        kwargs = {"vocab_size": meta["vocab_size"], **kwargs}
        model = self._build(name, entry_point(name, kwargs), kwargs)
        load_model(model, str(path))
        return model

    @staticmethod
    def _build(name: str, build, kwargs: dict) -> nn.Module:
        model = cast("CreatedModel", build(**kwargs))  # given its attributes below
        model.model_name, model.model_kwargs = name, dict(kwargs)
        model.pretrained_cfg = {"architecture": name, "vocab_size": cast(LanguageModel, model).vocab_size}
        return model


LM_ADAPTER = LanguageModelAdapter()


def _info(name: str) -> ModelInfo:
    return ModelInfo(name, input_size=0, paper=_PAPER, small=name.endswith("_nano"), task="lm", adapter=LM_ADAPTER)


# one entry per name: <mixer>_lm_<size>, the size from LM_SIZES
@register_model(info=_info("lambda_lm_nano"), args=_size_args({**LAMBDA_ARGS, **LAMBDA_DEFAULTS["nano"]}, "nano"))
def lambda_lm_nano(**kwargs) -> LanguageModel:
    return _lm("lambda", "nano", **{**LAMBDA_DEFAULTS["nano"], **kwargs})


@register_model(info=_info("plain_lambda_lm_nano"), args=_size_args(LAMBDA_ARGS, "nano"))
def plain_lambda_lm_nano(**kwargs) -> LanguageModel:
    return _lm("lambda", "nano", **kwargs)


@register_model(info=_info("lambda_lm_tiny"), args=_size_args({**LAMBDA_ARGS, **LAMBDA_DEFAULTS["tiny"]}, "tiny"))
def lambda_lm_tiny(**kwargs) -> LanguageModel:
    return _lm("lambda", "tiny", **{**LAMBDA_DEFAULTS["tiny"], **kwargs})


@register_model(info=_info("plain_lambda_lm_tiny"), args=_size_args(LAMBDA_ARGS, "tiny"))
def plain_lambda_lm_tiny(**kwargs) -> LanguageModel:
    return _lm("lambda", "tiny", **kwargs)


@register_model(info=_info("lambda_lm_small"), args=_size_args({**LAMBDA_ARGS, **LAMBDA_DEFAULTS["small"]}, "small"))
def lambda_lm_small(**kwargs) -> LanguageModel:
    return _lm("lambda", "small", **{**LAMBDA_DEFAULTS["small"], **kwargs})


@register_model(info=_info("plain_lambda_lm_small"), args=_size_args(LAMBDA_ARGS, "small"))
def plain_lambda_lm_small(**kwargs) -> LanguageModel:
    return _lm("lambda", "small", **kwargs)


@register_model(info=_info("lambda_lm_base"), args=_size_args({**LAMBDA_ARGS, **LAMBDA_DEFAULTS["base"]}, "base"))
def lambda_lm_base(**kwargs) -> LanguageModel:
    return _lm("lambda", "base", **{**LAMBDA_DEFAULTS["base"], **kwargs})


@register_model(info=_info("plain_lambda_lm_base"), args=_size_args(LAMBDA_ARGS, "base"))
def plain_lambda_lm_base(**kwargs) -> LanguageModel:
    return _lm("lambda", "base", **kwargs)


@register_model(info=_info("linear_lm_nano"), args=_size_args(LAMBDA_ARGS, "nano"))
def linear_lm_nano(**kwargs) -> LanguageModel:
    return _lm("linear", "nano", **kwargs)


@register_model(info=_info("linear_lm_tiny"), args=_size_args(LAMBDA_ARGS, "tiny"))
def linear_lm_tiny(**kwargs) -> LanguageModel:
    return _lm("linear", "tiny", **kwargs)


@register_model(info=_info("linear_lm_small"), args=_size_args(LAMBDA_ARGS, "small"))
def linear_lm_small(**kwargs) -> LanguageModel:
    return _lm("linear", "small", **kwargs)


@register_model(info=_info("linear_lm_base"), args=_size_args(LAMBDA_ARGS, "base"))
def linear_lm_base(**kwargs) -> LanguageModel:
    return _lm("linear", "base", **kwargs)


@register_model(info=_info("hybrid_lm_nano"), args=_size_args({**HYBRID_ARGS, "attention_every": 2}, "nano"))
def hybrid_lm_nano(**kwargs) -> LanguageModel:
    return _lm("hybrid", "nano", **{"attention_every": 2, **kwargs})


@register_model(info=_info("hybrid_lm_tiny"), args=_size_args(HYBRID_ARGS, "tiny"))
def hybrid_lm_tiny(**kwargs) -> LanguageModel:
    return _lm("hybrid", "tiny", **kwargs)


@register_model(info=_info("hybrid_lm_small"), args=_size_args(HYBRID_ARGS, "small"))
def hybrid_lm_small(**kwargs) -> LanguageModel:
    return _lm("hybrid", "small", **kwargs)


@register_model(info=_info("hybrid_lm_base"), args=_size_args(HYBRID_ARGS, "base"))
def hybrid_lm_base(**kwargs) -> LanguageModel:
    return _lm("hybrid", "base", **kwargs)


@register_model(info=_info("transformer_lm_nano"), args=_size_args(TRANSFORMER_ARGS, "nano", "transformer"))
def transformer_lm_nano(**kwargs) -> LanguageModel:
    return _lm("transformer", "nano", **kwargs)


@register_model(info=_info("transformer_lm_tiny"), args=_size_args(TRANSFORMER_ARGS, "tiny", "transformer"))
def transformer_lm_tiny(**kwargs) -> LanguageModel:
    return _lm("transformer", "tiny", **kwargs)


@register_model(info=_info("transformer_lm_small"), args=_size_args(TRANSFORMER_ARGS, "small", "transformer"))
def transformer_lm_small(**kwargs) -> LanguageModel:
    return _lm("transformer", "small", **kwargs)


@register_model(info=_info("transformer_lm_base"), args=_size_args(TRANSFORMER_ARGS, "base", "transformer"))
def transformer_lm_base(**kwargs) -> LanguageModel:
    return _lm("transformer", "base", **kwargs)
