"""What a training configuration's options imply, and the inverse: the model's paper values a recipe takes, the
model and options of a checkpoint fine-tuned (:func:`checkpoint_values`), and a configuration file's values
without what its own options implied where flags change those options (:func:`without_implied`; what the data
and the model imply is :func:`lambdanet.tasks.classification.config.resolve_model_values`)."""

from __future__ import annotations


from lambdanet.engine.config import changed_by
from lambdanet.models import model_args, model_info
from lambdanet.tasks.classification.datasets import dataset_spec
from lambdanet.tasks.classification.load import checkpoint_settings

__all__ = ["RECIPE_MODEL_KEYS", "checkpoint_values", "without_implied"]

# the values a recipe takes from the model's paper metadata (``ModelInfo.recipe``, Tables 19-20 for
# LambdaResNets): image size, RandAugment magnitude, dropout and stochastic depth depend on the model
RECIPE_MODEL_KEYS: dict[str, tuple[str, ...]] = {
    "paper350": ("img_size", "randaugment_magnitude", "drop_rate", "drop_path_rate")
}
# the paper values a recipe takes beside the dropout and stochastic depth (which every model implies)
_PAPER_KEYS = tuple(sorted({k for keys in RECIPE_MODEL_KEYS.values() for k in keys} - {"drop_rate", "drop_path_rate"}))
_MISSING = object()


def checkpoint_values(explicit: dict) -> dict:
    """Fine-tuning from what ``lambdanet train`` wrote (``checkpoint``: a run directory, its safetensors weights
    or its ``last.pt``) builds the checkpoint's model: ``explicit`` with the model, its architecture options
    (``model_kwargs``, stem and width included) and its image size filled in from the checkpoint's header
    (:func:`lambdanet.tasks.classification.load.checkpoint_settings`) where not given. Given ``model_kwargs``
    override single options; a given ``img_size`` builds the model at that size (given as null: the dataset's); another
    ``model`` is refused."""
    ckpt = explicit.get("checkpoint")
    given = explicit.get("model_kwargs") or {}
    if not ckpt or explicit.get("pretrained") or not isinstance(given, dict):
        return explicit  # nothing to take, or an error validate() reports
    settings = checkpoint_settings(ckpt)
    if settings is None:  # timm's weights, or a file the weight loader will report on
        return explicit
    model = settings["model"]
    if explicit.get("model") not in (None, model):
        raise ValueError(
            f"model {explicit['model']!r} does not match checkpoint {str(ckpt)!r}, which holds "
            f"{model!r}: drop --model (or the config file's model:) to fine-tune the checkpoint's model"
        )
    kwargs = dict(settings["model_kwargs"])
    for key in ("drop_rate", "drop_path_rate"):  # regularisation, not architecture: the new run's own
        kwargs.pop(key, None)  # (its flags, its recipe's paper values, or the model's defaults)
    if "img_size" in explicit:  # built at the size asked for (global attention must then fit it); null given:
        kwargs.pop("img_size", None)  # the dataset's, as the option says
    accepted = model_args(model)
    for key in ("stem", "base_width"):  # the checkpoint's own, never the small-image / compact defaults
        if key in accepted:
            kwargs.setdefault(key, None)
    out = {**explicit, "model": model, "model_kwargs": {**kwargs, **given}}
    if "img_size" not in explicit and settings["image_size"] is not None:
        out["img_size"] = settings["image_size"]
    return out


def without_implied(values: dict, flags: dict) -> dict:
    """A ``--config`` file's ``values`` without what its own options implied where ``flags`` change those options
    (:meth:`RunConfig.without_implied <lambdanet.engine.config.RunConfig.without_implied>`): the image size the
    data implied, where ``--data`` changes it; the checkpoint's model, options and image size, where
    ``--checkpoint`` changes it; the dropout, stochastic depth and recipe paper values of the model, where
    ``--model`` changes it; and in ``model_kwargs`` the ``img_size`` and small-image ``stem`` the image size
    implied and the ``base_width`` of ``compact_width``, where a flag changes those (or the model, or the
    checkpoint, which imply them again)."""
    out, kwargs = dict(values), values.get("model_kwargs")
    kwargs = dict(kwargs) if isinstance(kwargs, dict) else {}
    new_checkpoint = changed_by(flags, values, "checkpoint")
    if new_checkpoint and values.get("checkpoint"):
        try:
            old = checkpoint_values({"checkpoint": values["checkpoint"]})
        except (ValueError, OSError):  # gone or unreadable: the file's values stay given
            old = {}
        _drop_equal(out, old, ("model", "img_size"))
        kwargs = {k: v for k, v in kwargs.items() if (old.get("model_kwargs") or {}).get(k, _MISSING) != v}
    if changed_by(flags, values, "data") or new_checkpoint:
        if not values.get("checkpoint") and not values.get("pretrained"):
            _drop_equal(out, {"img_size": _data_size(values.get("data"))}, ("img_size",))
    if changed_by(flags, values, "model") and isinstance(model := values.get("model"), str):
        _drop_equal(out, _model_implies(model, values.get("recipe")), ("drop_rate", "drop_path_rate", *_PAPER_KEYS))
    resized = "img_size" not in out or changed_by(flags, values, "img_size", "model") or new_checkpoint
    size = values.get("img_size")
    if resized and size is not None:
        _drop_equal(kwargs, {"img_size": size, **({"stem": "cifar"} if size <= 64 else {})}, ("img_size", "stem"))
    if changed_by(flags, values, "compact_width", "model") or new_checkpoint:
        _drop_equal(kwargs, {"base_width": values.get("compact_width")}, ("base_width",))
    if "model_kwargs" in values:
        out["model_kwargs"] = kwargs
    return out


def _drop_equal(values: dict, implied: dict, names: tuple[str, ...]) -> None:
    """Remove from ``values`` (in place) each of ``names`` whose value is ``implied``'s (and not ``None``)."""
    for name in names:
        if values.get(name) is not None and values.get(name) == implied.get(name, _MISSING):
            del values[name]


def _data_size(data) -> int | None:
    """The image size ``data`` implies, ``None`` where it cannot be told (an unknown or unreadable dataset)."""
    try:
        return dataset_spec(data).image_size if isinstance(data, str) else None
    except (ValueError, OSError):
        return None


def _model_implies(model: str, recipe) -> dict:
    """What ``model`` implies of the options: its dropout and stochastic depth, and the paper values ``recipe``
    takes from it; ``{}`` for an unknown name (reported later)."""
    try:
        accepted, paper = model_args(model), model_info(model).recipe
    except ValueError:
        return {}
    implied = {k: accepted[k] for k in ("drop_rate", "drop_path_rate") if k in accepted}
    return {**implied, **{k: paper[k] for k in RECIPE_MODEL_KEYS.get(recipe, ()) if k in paper}}
