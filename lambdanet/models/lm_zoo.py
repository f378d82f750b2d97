"""The registered language models, ``<mixer>_lm_<size>`` (:class:`~lambdanet.models.lm.LanguageModel` of a size
of :data:`~lambdanet.models.lm.LM_SIZES`), and how :func:`~lambdanet.models.create_model` builds them
(:class:`LanguageModelAdapter`). Each takes its architecture options as keywords: ``vocab_size``, ``heads`` and
``mlp_ratio``; the lambda families also ``dim_k``, ``r``, ``dim_v``, ``dim_u``, ``chunk``, ``decay``,
``short_conv``, ``lambdas``, ``content``, ``key_norm``, ``query_softmax`` (the hybrid ``attention_every``); the
transformer ``positions`` and ``max_len``.

``lambda_lm_<size>`` runs a short causal convolution of width :data:`LAMBDA_SHORT_CONV` before its lambdas and
lets the content summary forget at a learnt rate per key channel (``decay=`` :data:`LAMBDA_DECAY`): the best
configuration of issue 37's ablation study (``fixed_conv4``, docs/language_models.md). ``plain_lambda_lm_<size>``
is the paper's masked lambda layer alone, the default of 0.1.0. The default moved twice while 0.2.0 was
developed: to the convolution alone (``short_conv4``), then to ``fixed_conv4``. Runs write the options whose
default moved (:func:`pin_lm_kwargs`), and a run written before reads back as the model it trained
(:func:`saved_lm`)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, cast

from torch import nn

from lambdanet.models.lm import LM_SIZES, LanguageModel
from lambdanet.models.registry import ModelAdapter, ModelInfo, entry_point, register_model

if TYPE_CHECKING:
    from lambdanet.models.registry import CreatedModel

__all__ = ["LanguageModelAdapter", "LM_ADAPTER", "LAMBDA_SHORT_CONV", "LAMBDA_DECAY", "LAMBDA_DEFAULTS",
           "lambda_defaults", "pin_lm_kwargs", "saved_lm"]  # fmt: skip


def _lm(mixer: str, size: str, **kwargs) -> LanguageModel:
    s = LM_SIZES[size]
    return LanguageModel(mixer, s.dim, s.depth, **{**_size_args({}, size, mixer), **kwargs})


def _size_args(args: dict, size: str, mixer: str = "lambda") -> dict:
    """A family's architecture arguments with the size's own defaults: ``heads`` and ``mlp_ratio``, and for the
    lambda mixers ``dim_k`` and ``r`` (the ablations of docs/language_models.md vary them; the linear mixer has
    no position lambdas, so no ``r``)."""
    s = LM_SIZES[size]
    own = {"heads": s.heads, "mlp_ratio": s.mlp_ratio}
    lambdas = {"dim_k": s.dim_k, **({} if mixer == "linear" else {"r": s.r})}
    return {**args, **own, **({} if mixer == "transformer" else lambdas)}


_PAPER = "LambdaNetworks App. B.2 (masked lambdas) on sequences; baselines of the same size"
LAMBDA_ARGS = {"vocab_size": 256, "dim_v": None, "dim_u": 1, "chunk": 64, "dropout": 0.0, "decay": None,
               "short_conv": 0, "lambdas": 1, "content": True, "key_norm": "softmax",
               "query_softmax": False}  # fmt: skip
HYBRID_ARGS = {**LAMBDA_ARGS, "attention_every": 4}
LINEAR_ARGS = {k: v for k, v in LAMBDA_ARGS.items() if k != "content"}  # content lambdas only: no r, no content=False
LAMBDA_SHORT_CONV = 4  # lambda_lm_<size>'s short convolution: 1.1% lower bits per byte over 3 seeds (the study)
LAMBDA_DECAY = "fixed"  # and its decay: with the convolution, 0.7% below the convolution alone, lower in 3 of 3 seeds
# what lambda_lm_<size> sets over plain_lambda_lm_<size>: the convolution, the decay (dim_k x dim_u rates per layer),
# and at nano the value depth that keeps the parameters within 2% of the transformer's (the convolution's 4 x 480
# weights per layer are 2.2% of nano's budget)
LAMBDA_DEFAULTS = {size: {"short_conv": LAMBDA_SHORT_CONV, "decay": LAMBDA_DECAY,
                          **({"dim_v": 64} if size == "nano" else {})} for size in LM_SIZES}  # fmt: skip
TRANSFORMER_ARGS = {"vocab_size": 256, "positions": "rotary", "max_len": None, "dropout": 0.0}
_DEFAULT_LAMBDA = re.compile(rf"lambda_lm_({'|'.join(LM_SIZES)})")


def lambda_defaults(size: str, kwargs: Mapping) -> dict:
    """What ``lambda_lm_<size>`` sets over ``plain_lambda_lm_<size>`` when built with ``kwargs``:
    :data:`LAMBDA_DEFAULTS`, with ``decay=None`` where ``kwargs`` turn off what the decay needs (the content
    lambdas' prefix softmax: ``content=False``, or a ``key_norm`` other than ``"softmax"``), so those options build
    the model without it instead of failing on a default the user never named; and without nano's value depth
    where ``heads`` or ``dim_k`` are not the size's (the depth then follows them, as the plain model's does)."""
    defaults, s = dict(LAMBDA_DEFAULTS[size]), LM_SIZES[size]
    if not kwargs.get("content", True) or kwargs.get("key_norm", "softmax") != "softmax":
        defaults["decay"] = None
    if (kwargs.get("heads", s.heads), kwargs.get("dim_k", s.dim_k)) != (s.heads, s.dim_k):
        defaults.pop("dim_v", None)  # nano's value depth was matched at its own shape: another follows matched_dim_v
    return defaults


def pin_lm_kwargs(model: str, model_kwargs: Mapping) -> dict:
    """``model_kwargs`` as a run records them: with the options whose default moved written out (what a
    ``lambda_lm_<size>`` sets over the plain model, :func:`lambda_defaults`), so the run stays the model it trained
    if a default moves again."""
    kwargs = dict(model_kwargs)
    if match := _DEFAULT_LAMBDA.fullmatch(model):
        kwargs = {**lambda_defaults(match[1], kwargs), **kwargs}
    return kwargs


def saved_lm(model: str, model_kwargs: Mapping) -> tuple[str, dict]:
    """The registered model and options that a saved run's (or shared weights') ``model`` and ``model_kwargs``
    describe. :func:`pin_lm_kwargs` writes out the options whose default moved, so a ``lambda_lm_<size>`` that
    lacks one was written before that default:

    * no ``short_conv``: written by 0.1.0 (or before the convolution became the default), the plain lambda model,
      ``plain_lambda_lm_<size>``;
    * ``short_conv`` but no ``decay``: written while the convolution alone was the default (``short_conv4``), the
      same model with ``decay=None``.

    Options that never had an effect are dropped: ``r`` and ``content`` of a ``linear_lm_<size>`` (whose mixer had no
    position lambdas), ``max_len`` of a transformer with rotary positions; a hybrid whose ``attention_every`` exceeds
    its depth had no attention block: it is the plain lambda model. Any other model and options are themselves."""
    kwargs = dict(model_kwargs)
    if model.startswith("linear_lm_"):
        kwargs = {k: v for k, v in kwargs.items() if k not in ("r", "content")}
    if model.startswith("transformer_lm_") and kwargs.get("positions", "rotary") != "learned":
        kwargs.pop("max_len", None)
    hybrid = re.fullmatch(rf"hybrid_lm_({'|'.join(LM_SIZES)})", model)
    if hybrid and kwargs.get("attention_every", 0) > LM_SIZES[hybrid[1]].depth:  # it had no attention block
        return f"plain_lambda_lm_{hybrid[1]}", {k: v for k, v in kwargs.items() if k != "attention_every"}
    if not _DEFAULT_LAMBDA.fullmatch(model):
        return model, kwargs
    if "short_conv" not in kwargs:
        return f"plain_{model}", kwargs
    if "decay" not in kwargs:
        return model, {**kwargs, "decay": None}
    return model, kwargs


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

    def saved(self, name: str, kwargs: Mapping) -> tuple[str, dict]:
        """Runs and weights written before ``lambda_lm_<size>``'s default moved build the model they trained
        (:func:`saved_lm`)."""
        return saved_lm(name, kwargs)

    def from_hub(self, repo, name, path, meta, kwargs, *, num_classes, in_chans) -> nn.Module:
        """The hub's ``vocab_size`` (``num_classes`` and ``in_chans`` do not apply); ``name`` and ``kwargs`` as
        :meth:`saved` read them."""
        from safetensors.torch import load_model

        if kwargs.get("vocab_size", meta["vocab_size"]) != meta["vocab_size"]:  # the embedding's rows are the weights'
            raise ValueError(f"vocab_size={kwargs['vocab_size']!r} does not fit hf-hub:{repo}, trained with vocab_size="
                             f"{meta['vocab_size']} (leave it out: the repository's is used)")  # fmt: skip
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
    return _lm("lambda", "nano", **{**lambda_defaults("nano", kwargs), **kwargs})


@register_model(info=_info("plain_lambda_lm_nano"), args=_size_args(LAMBDA_ARGS, "nano"))
def plain_lambda_lm_nano(**kwargs) -> LanguageModel:
    return _lm("lambda", "nano", **kwargs)


@register_model(info=_info("lambda_lm_tiny"), args=_size_args({**LAMBDA_ARGS, **LAMBDA_DEFAULTS["tiny"]}, "tiny"))
def lambda_lm_tiny(**kwargs) -> LanguageModel:
    return _lm("lambda", "tiny", **{**lambda_defaults("tiny", kwargs), **kwargs})


@register_model(info=_info("plain_lambda_lm_tiny"), args=_size_args(LAMBDA_ARGS, "tiny"))
def plain_lambda_lm_tiny(**kwargs) -> LanguageModel:
    return _lm("lambda", "tiny", **kwargs)


@register_model(info=_info("lambda_lm_small"), args=_size_args({**LAMBDA_ARGS, **LAMBDA_DEFAULTS["small"]}, "small"))
def lambda_lm_small(**kwargs) -> LanguageModel:
    return _lm("lambda", "small", **{**lambda_defaults("small", kwargs), **kwargs})


@register_model(info=_info("plain_lambda_lm_small"), args=_size_args(LAMBDA_ARGS, "small"))
def plain_lambda_lm_small(**kwargs) -> LanguageModel:
    return _lm("lambda", "small", **kwargs)


@register_model(info=_info("lambda_lm_base"), args=_size_args({**LAMBDA_ARGS, **LAMBDA_DEFAULTS["base"]}, "base"))
def lambda_lm_base(**kwargs) -> LanguageModel:
    return _lm("lambda", "base", **{**lambda_defaults("base", kwargs), **kwargs})


@register_model(info=_info("plain_lambda_lm_base"), args=_size_args(LAMBDA_ARGS, "base"))
def plain_lambda_lm_base(**kwargs) -> LanguageModel:
    return _lm("lambda", "base", **kwargs)


@register_model(info=_info("linear_lm_nano"), args=_size_args(LINEAR_ARGS, "nano", "linear"))
def linear_lm_nano(**kwargs) -> LanguageModel:
    return _lm("linear", "nano", **kwargs)


@register_model(info=_info("linear_lm_tiny"), args=_size_args(LINEAR_ARGS, "tiny", "linear"))
def linear_lm_tiny(**kwargs) -> LanguageModel:
    return _lm("linear", "tiny", **kwargs)


@register_model(info=_info("linear_lm_small"), args=_size_args(LINEAR_ARGS, "small", "linear"))
def linear_lm_small(**kwargs) -> LanguageModel:
    return _lm("linear", "small", **kwargs)


@register_model(info=_info("linear_lm_base"), args=_size_args(LINEAR_ARGS, "base", "linear"))
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
