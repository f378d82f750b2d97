"""Pretrained weights: timm's ImageNet checkpoints on lambdanet's layers, and local weight files.

``create_model(name, pretrained=True)`` downloads the checkpoint of ``name`` from the Hugging Face hub
(``huggingface_hub``; repository ids from :func:`lambdanet.models.registry.published_models`), converts its
keys to lambdanet's modules (:func:`convert_timm_state_dict`) and caches the converted weights as safetensors
under :func:`cache_dir`; the next call reads the cache without touching the network.
``create_model(name, checkpoint_path=FILE)`` loads a local file instead: a timm state dict of that model
(``.pth``, ``.bin``, ``.safetensors``, also wrapped under ``"state_dict"`` / ``"model"``) or lambdanet's own
weights (``model.safetensors`` of a run, :func:`save_weights`), told apart by their keys.

A model built with another ``num_classes`` than the checkpoint's keeps a fresh classifier (fine-tuning); one
built with another ``in_chans`` gets the checkpoint's input convolution adapted (:func:`adapt_input_conv`,
timm's rule). A run directory of ``lambdanet train`` stands for its weights file
(:func:`lambdanet.files.run_file`); the files themselves are read by :mod:`lambdanet.files`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor, nn

from lambdanet.files import (
    WeightsMismatchError,
    error_reason,
    give_usual_mode,
    read_state_dict,
    run_file,
    run_metadata,
)
from lambdanet.layers import HaloAttention, LambdaLayer, RelativeSelfAttention
from lambdanet.models.hub import hub_download
from lambdanet.models.registry import published_models, run_image_cfg

if TYPE_CHECKING:
    from lambdanet.models.registry import CreatedModel

__all__ = [
    "PretrainedUnavailableError",
    "HUB_FILENAME",
    "cache_dir",
    "hub_id",
    "convert_timm_state_dict",
    "adapt_input_conv",
    "tie_shared",
    "load_weights",
    "dropped_classifier",
    "load_state",
    "load_pretrained",
    "load_into",
    "download_weights",
]

HUB_FILENAME = "model.safetensors"  # what timm publishes in each hub repository


class PretrainedUnavailableError(ValueError):
    """Weights asked for with ``pretrained=True`` could not be had (offline, no such checkpoint)."""


def cache_dir() -> Path:
    """Where converted checkpoints are kept: ``$LAMBDANET_CACHE``, else ``~/.cache/lambdanet/weights``."""
    root = os.environ.get("LAMBDANET_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "lambdanet" / "weights"


def hub_id(name: str) -> str:
    """The Hugging Face hub repository of ``name``'s checkpoint (``ValueError`` for models without one)."""
    published = published_models()
    if name not in published:
        raise PretrainedUnavailableError(
            f"no pretrained weights are published for {name!r}; models with weights: {', '.join(sorted(published))} "
            f"(for your own weights pass checkpoint_path=FILE; {_CLI_FILE})"
        )
    return cast(str, published[name].hub_id)  # published_models keeps the models with a hub_id


def _lambda_keys(layer: LambdaLayer, sd: dict[str, Tensor], p: str) -> None:
    """timm ``LambdaLayer``: 1x1-conv ``qkv``, Conv3d ``conv_lambda`` (``[k, 1, r, r, 1]`` + bias) or a global
    ``pos_emb`` ``[2H-1, 2W-1, k]`` -> our ``qkv`` (linear), ``embedding.weight`` ``[k, taps]``, ``position_bias``."""
    sd[p + "qkv.weight"] = sd[p + "qkv.weight"].flatten(1)  # (q k v) d
    if p + "conv_lambda.weight" in sd:  # k 1 r r 1: cross-correlation, tap (i, j) = offset (i - r//2, j - r//2)
        w = sd.pop(p + "conv_lambda.weight")
        sd[p + "embedding.weight"] = w.reshape(w.shape[0], -1)  # k (r r)
        sd[p + "position_bias"] = sd.pop(p + "conv_lambda.bias")
    if p + "pos_emb" in sd:
        e = sd.pop(p + "pos_emb")  # 2H-1 2W-1 k, entry (i, j) = offset (i - (H-1), j - (W-1))
        sd[p + "embedding.weight"] = e.permute(2, 0, 1).reshape(e.shape[2], -1)  # k ((2H-1) (2W-1))
    sd.pop(p + "rel_pos_indices", None)


def _halo_keys(layer: HaloAttention, sd: dict[str, Tensor], p: str) -> None:
    """timm ``HaloAttn``: ``kv`` rows interleaved per head (``[k_h, v_h]`` for each head h) -> ours
    ``[k (all heads), v (all heads)]``; ``pos_embed.{height,width}_rel`` -> ``rel.rel_{h,w}``."""
    h, dk, dv = layer.heads, layer.dim_qk // layer.heads, layer.dim_out // layer.heads
    kv = sd[p + "kv.weight"].unflatten(0, (h, dk + dv))  # (h (dk + dv)) d 1 1 -> h (dk + dv) d 1 1
    sd[p + "kv.weight"] = torch.cat([kv[:, :dk].flatten(0, 1), kv[:, dk:].flatten(0, 1)])  # (h dk + h dv) d 1 1
    _bottleneck_keys(layer, sd, p)


def _bottleneck_keys(layer: RelativeSelfAttention | HaloAttention, sd: dict[str, Tensor], p: str) -> None:
    """timm ``BottleneckAttn``: the same ``qkv`` layout as ours; relative tables renamed (also ``HaloAttn``'s)."""
    sd[p + "rel.rel_h"] = sd.pop(p + "pos_embed.height_rel")
    sd[p + "rel.rel_w"] = sd.pop(p + "pos_embed.width_rel")


# module type -> its converter, which takes a module of that type
_CONVERTERS: dict[type[nn.Module], Callable[[Any, dict[str, Tensor], str], None]] = {
    LambdaLayer: _lambda_keys,
    HaloAttention: _halo_keys,
    RelativeSelfAttention: _bottleneck_keys,
}


def convert_timm_state_dict(model: nn.Module, state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """timm's state dict of ``model``'s architecture (:data:`lambdanet.models.byoa.model_cfgs`) with lambdanet's
    keys and layouts: trunk names kept, classifier ``head.fc`` -> ``fc``, attention layers converted by type."""
    sd = {k.removeprefix("module."): v for k, v in state_dict.items()}
    for key in ("weight", "bias"):
        if f"head.fc.{key}" in sd:
            sd[f"fc.{key}"] = sd.pop(f"head.fc.{key}")
    for name, module in model.named_modules():
        convert = _CONVERTERS.get(type(module))
        if convert is not None and any(k.startswith(name + ".") for k in sd):
            try:
                convert(module, sd, name + ".")
            except KeyError:  # not this layer's timm keys: left for load_weights to report
                pass
    return sd


_FC = ("fc.weight", "fc.bias")


def adapt_input_conv(weight: Tensor, in_chans: int, dtype: torch.dtype | None = None) -> Tensor:
    """The weight ``[out, N, kh, kw]`` of a convolution reading N-channel images, for ``in_chans`` = M channels
    (timm's rule, ``timm.models.adapt_input_conv``, generalised from N = 3): summed over the N channels for M = 1
    (a grey image is R = G = B); otherwise the N channels repeated cyclically up to M and scaled by N / M, so that
    an image whose channels are equal gives the same output (exactly when M is a multiple of N, e.g. 1 -> 3: the
    weight repeated, divided by 3). Computed in float64, rounded once to ``dtype`` (default: ``weight``'s)."""
    n = weight.shape[1]
    if n == in_chans:
        return weight
    w = weight.double()
    w = (
        w.sum(dim=1, keepdim=True)
        if in_chans == 1
        else w.repeat(1, -(-in_chans // n), 1, 1)[:, :in_chans] * (n / in_chans)
    )
    return w.to(dtype or weight.dtype)


def _input_conv_key(model: nn.Module) -> str | None:
    """The state-dict key of the convolution that reads the image: the model's first ``Conv2d`` (the stem's)."""
    for name, m in model.named_modules():
        if isinstance(m, nn.Conv2d):
            return f"{name}.weight" if m.groups == 1 else None
    return None


def tie_shared(model: nn.Module, sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """``sd`` with the keys of ``model``'s shared tensors (e.g. ``share_embeddings``) that safetensors stores
    once filled in from the stored one (in place; returned)."""
    groups: dict[tuple, list[str]] = {}
    for k, v in model.state_dict(keep_vars=True).items():
        if v.numel():
            groups.setdefault((v.device, v.data_ptr(), tuple(v.shape), v.stride()), []).append(k)
    for keys in groups.values():
        stored = next((k for k in keys if k in sd), None)
        if stored is not None and len(keys) > 1:
            for k in keys:
                sd.setdefault(k, sd[stored])
    return sd


_DROPPED = "the checkpoint's {}-class classifier is not loaded"  # _fit's note, which dropped_classifier reads
_DROPPED_NOTE = re.compile(re.escape(_DROPPED).replace(r"\{\}", r"(\d+)"))


# where the commands take a weights file instead of published weights
_CLI_FILE = (
    "train: --checkpoint FILE; detect: --backbone-kwargs checkpoint_path=FILE --pretrain-steps 0, without "
    "--pretrained-backbone"
)


def dropped_classifier(notes: Sequence[str]) -> int | None:
    """The classes of the checkpoint's classifier that loading left out for one of another width (its note among
    ``notes``, a model's ``pretrained_cfg["load_notes"]``), else ``None``."""
    found = (_DROPPED_NOTE.match(note) for note in notes)
    return next((int(m.group(1)) for m in found if m), None)


def _fit(model: nn.Module, own: dict[str, Tensor], sd: dict[str, Tensor]) -> tuple[dict[str, Tensor], list[str]]:
    """Drop a classifier of another width than ``model``'s (state dict ``own``) from ``sd`` and adapt its input
    convolution to the model's channels (:func:`adapt_input_conv`). Returns (state dict, notes)."""
    notes = []
    if "fc.weight" in sd and ("fc.weight" not in own or own["fc.weight"].shape != sd["fc.weight"].shape):
        classes = sd["fc.weight"].shape[0]
        for key in _FC:
            sd.pop(key, None)
        new = f"a new one ({getattr(model, 'num_classes', '?')} classes)"
        notes.append(_DROPPED.format(classes) + f": the model has {new if 'fc.weight' in own else 'no classifier'}")
    conv_key = _input_conv_key(model)  # None: no plain input convolution
    value, mine = (sd.get(conv_key), own.get(conv_key)) if conv_key is not None else (None, None)
    if (
        conv_key is not None
        and value is not None
        and mine is not None
        and value.dim() == 4 == mine.dim()
        and value.shape[1] != mine.shape[1]
        and value.shape[0] == mine.shape[0]
        and value.shape[2:] == mine.shape[2:]
    ):
        n, m = value.shape[1], mine.shape[1]
        sd[conv_key] = adapt_input_conv(value, m, mine.dtype)
        how = "summed over them" if m == 1 else f"repeated over them and scaled by {n}/{m}"
        notes.append(
            f"the input convolution {conv_key} is adapted from the checkpoint's {n} input channel"
            f"{'s' * (n != 1)} to the model's {m} ({how})"
        )
    return sd, notes


def load_weights(
    model: nn.Module, path: str | os.PathLike, name: str | None = None, *, source: str | None = None
) -> list[str]:
    """Load a weights file into ``model`` (:func:`load_state`; ``source``: what errors call the file, by default
    ``checkpoint_path '...'``). Returns notes on what was adapted."""
    source = source or f"checkpoint_path {str(path)!r}"
    return load_state(model, read_state_dict(path), source=source, name=name, path=path)


def load_state(
    model: nn.Module,
    state_dict: Mapping[str, Tensor],
    *,
    source: str = "the weights",
    name: str | None = None,
    path: str | os.PathLike | None = None,
) -> list[str]:
    """The one way weights enter a model (every loader of the package calls it): lambdanet's own keys as they are,
    timm's converted (:func:`convert_timm_state_dict`), tensors shared in the model filled in (:func:`tie_shared`),
    a classifier of another width left out and the input convolution adapted to the model's channels; otherwise
    strict, a :class:`WeightsMismatchError` naming ``source`` and the model (``name``) on one line. ``path``: the
    file the weights came from, whose header explains a mismatch. Returns notes on what was adapted."""
    sd = tie_shared(model, dict(state_dict))
    own = model.state_dict()
    if set(sd) - set(_FC) != set(own) - set(_FC):  # not lambdanet's own keys: timm's
        sd = convert_timm_state_dict(model, sd)
    sd, notes = _fit(model, own, sd)
    label = name or type(model).__name__
    shapes = [k for k, v in sd.items() if k in own and v.shape != own[k].shape]
    if shapes:
        k = shapes[0]
        raise WeightsMismatchError(
            f"{source} does not fit {label}: {len(shapes)} tensors have other shapes, e.g. {k} "
            f"{tuple(sd[k].shape)} in the file, {tuple(own[k].shape)} in the model ({_shape_hint(model, path, k)})"
        )
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if k not in _FC]
    if missing or unexpected:
        raise WeightsMismatchError(
            f"{source} does not fit {label}: {len(missing)} missing keys {missing[:3]}, {len(unexpected)} "
            f"unexpected {unexpected[:3]} (is it a checkpoint of this model?)"
        )
    return notes


def _shape_hint(model: nn.Module, path, key: str) -> str:
    """Why a tensor of a weights file may not fit: the file header's settings, else global attention sized by
    another image size, else other architecture options."""
    meta = run_metadata(path) if path is not None else None
    if meta is not None:
        return (
            f"the file holds {meta['model']} built with {meta['model_kwargs']} for {meta['image_size']} px, "
            f"{meta['in_chans']}-channel images: build the model with those, as lambdanet.load_model(FILE) and "
            "lambdanet train --checkpoint FILE do"
        )
    attention = [n for n, m in model.named_modules() if type(m) in _CONVERTERS]
    if any(key.startswith(n + ".") for n in attention):
        return "global attention is sized by img_size: build the model at the checkpoint's"
    return "the checkpoint was built with other architecture options (stem, widths, layers): build the model with those"


def download_weights(repo_id: str) -> str:
    """Download ``repo_id``'s :data:`HUB_FILENAME` with ``huggingface_hub`` (its own cache); the local path.
    Offline it fails at once unless the file is cached (:func:`lambdanet.models.hub.hub_download`)."""
    return hub_download(repo_id, HUB_FILENAME)


def load_pretrained(model: nn.Module, name: str) -> list[str]:
    """Load ``name``'s published checkpoint into ``model``: from :func:`cache_dir` when converted before,
    else downloaded, converted and cached. ``PretrainedUnavailableError`` (one line naming the hub id and
    ``checkpoint_path``) when it cannot be downloaded."""
    repo = hub_id(name)
    cached = cache_dir() / f"{name}.safetensors"
    if not cached.is_file():
        try:
            path = download_weights(repo)
        except Exception as err:  # offline, hub errors, missing huggingface_hub
            reason = error_reason(err)
            raise PretrainedUnavailableError(
                f"pretrained weights of {name} could not be downloaded from the Hugging Face hub "
                f"({repo}: {reason}); download {HUB_FILENAME} from https://huggingface.co/{repo} and pass "
                f"checkpoint_path=FILE ({_CLI_FILE})"
            ) from err
        from safetensors.torch import save_file

        sd = convert_timm_state_dict(model, read_state_dict(path))
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(".tmp")
        save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp), metadata={"source": repo})
        give_usual_mode(tmp)  # not safetensors' 0600
        os.replace(tmp, cached)  # whole file or none: a crash never leaves half a cache entry
    return load_weights(
        model, cached, name, source=f"the published checkpoint of {name} ({repo}, cached at {str(cached)!r})"
    )


def load_into(
    model: nn.Module, name: str, *, pretrained: bool = False, checkpoint_path: str | os.PathLike | None = None
) -> None:
    """Load ``name``'s published weights (``pretrained``) or a weights file / run directory into ``model`` and
    record in its ``pretrained_cfg`` where they came from (``weights``), what was adapted (``load_notes``) and,
    for lambdanet's own run weights, their classes and preprocessing."""
    if checkpoint_path is not None:
        checkpoint_path = run_file(checkpoint_path)  # a run directory: its weights file
    # not pretrained: create_model was given a checkpoint_path
    notes = load_pretrained(model, name) if pretrained else load_weights(model, cast(Path, checkpoint_path), name)
    created = cast("CreatedModel", model)  # built by create_model: it has pretrained_cfg
    if checkpoint_path is not None:  # lambdanet's run weights describe their data: classes and preprocessing
        meta = run_metadata(checkpoint_path)
        if meta and "image_size" in meta:
            cfg = created.pretrained_cfg
            created.pretrained_cfg.update(
                run_image_cfg(
                    {
                        **meta,
                        "model": cfg["architecture"],
                        "num_classes": cfg["num_classes"],
                        "in_chans": cfg["input_size"][0],
                    }
                )
            )
        if any("classifier" in n for n in notes):
            created.pretrained_cfg["classes"] = None
    created.pretrained_cfg["weights"] = "pretrained" if pretrained else str(checkpoint_path)
    created.pretrained_cfg["load_notes"] = notes
