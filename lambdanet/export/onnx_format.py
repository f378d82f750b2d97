"""The ONNX side of :func:`lambdanet.export.export_model`: the dynamo exporter run quietly and without
onnxscript's unsound reshape-matmul-reshape rewrites, the weights kept in the ``.onnx`` file unless they
exceed the size given (then in one external ``.data`` file beside it). The optional packages ``onnx`` and
``onnxscript`` are imported only when an export runs."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor, nn

__all__ = ["onnx_export", "output_names", "external_locations", "without_reshape_matmul_rewrites"]


@contextlib.contextmanager
def _quiet_onnx() -> Iterator[None]:
    """Silence the ONNX optimiser's per-node log lines ("Skipping constant folding ...") during an export, and
    torch 2.11's own ``FutureWarning`` on its pytree's ``LeafSpec``, raised inside the exporter (nothing the
    caller could change; newer torch no longer raises it)."""
    logger = logging.getLogger("onnxscript")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)`", category=FutureWarning)
            yield
    finally:
        logger.setLevel(level)


# onnxscript's rewrite rules that replace Reshape -> MatMul -> Reshape by one broadcasting MatMul whenever the
# shapes line up, also where the first Reshape folds a batch dim into the rows: the lambda layers' queries-first
# GEMM [b, h n, m] x [b, m, v] (every head of an image against that image's values) became
# [b, h, n, m] x [b, m, v], which pairs head i with image i's values once a static batch b equals the heads h
# (with a symbolic batch the rules never apply). Pairs (module of the rules, module holding the optimiser's
# default rule list) for onnxscript's current and earlier layouts.
_UNSOUND_ONNX_RULES = (
    ("onnxscript.rewriter.rules.common._broadcast_to_matmul", "onnxscript.rewriter"),
    ("onnxscript.rewriter.broadcast_to_matmul", "onnxscript.rewriter"),
    ("onnxscript.rewriter.broadcast_to_matmul", "onnxscript.optimizer._optimizer"),
)


@contextlib.contextmanager
def without_reshape_matmul_rewrites() -> Iterator[None]:
    """The ONNX exporter's optimiser (constant folding, onnxscript's default rewrite rules) without the rules
    of :data:`_UNSOUND_ONNX_RULES`, restored afterwards; a no-op on an onnxscript without them (the check
    would catch a wrong file; tests/test_export.py exports a static batch equal to the heads)."""
    saved = []
    for rules_module, holder_module in _UNSOUND_ONNX_RULES:
        try:
            rules, holder = (importlib.import_module(m) for m in (rules_module, holder_module))
        except ImportError:
            continue
        unsound = {id(r) for r in getattr(getattr(rules, "rules", None), "rules", ())}
        default = getattr(holder, "_DEFAULT_REWRITE_RULES", None)
        if unsound and default is not None and any(id(r) in unsound for r in default):
            saved.append((holder, default))
            setattr(holder, "_DEFAULT_REWRITE_RULES", type(default)(r for r in default if id(r) not in unsound))
    try:
        yield
    finally:
        for holder, default in reversed(saved):
            setattr(holder, "_DEFAULT_REWRITE_RULES", default)


def onnx_export(model: nn.Module, x: Tensor, path: Path, dynamic_shapes, max_single_file_bytes: int) -> str | None:
    """Write ``model`` to ``path`` with the dynamo exporter (input ``image``, outputs named by
    :func:`output_names`), in one file unless its weights exceed
    ``max_single_file_bytes`` (see :mod:`lambdanet.export`); the external data file it wrote next to ``path``,
    or ``None``."""
    import onnx

    weight_bytes = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    external = weight_bytes > max_single_file_bytes
    kwargs = {"dynamo": True, "verbose": False, "input_names": ["image"], "output_names": output_names(model),
              "dynamic_shapes": dynamic_shapes}  # fmt: skip
    single_file_flag = "external_data" in inspect.signature(torch.onnx.export).parameters
    if single_file_flag:
        kwargs["external_data"] = external
    with _quiet_onnx(), without_reshape_matmul_rewrites():
        torch.onnx.export(model, (x,), str(path), **kwargs)
    locations = external_locations(path)
    if locations and not external and not single_file_flag:  # an exporter that always writes .data: merge it
        proto = onnx.load(str(path))  # with its external data
        onnx.save_model(proto, str(path), save_as_external_data=False)
        for location in locations:
            (path.parent / location).unlink(missing_ok=True)
        locations = external_locations(path)
    if len(locations) > 1:
        raise ValueError(f"{path}: the ONNX exporter wrote its weights to {len(locations)} files, expected one")
    return str(path.parent / locations[0]) if locations else None


def output_names(model: nn.Module) -> list[str]:
    """The ONNX file's output names, for its reader (the exporter would name them after their last ops:
    ``linear_12``, ``mean``, ``relu_12``): a classifier's ``logits``, a model without a classifier's
    (``num_classes=0``) ``features``, a feature pyramid's (``features_only=True``, or timm's feature models: a
    list of maps, one per entry of its ``feature_info``) ``features_0``, ``features_1``, ... Told from the
    model's attributes, without calling it (a forward may change a model's state). A model of another origin
    that returns several tensors gets its first one named."""
    pyramid = getattr(model, "features_only", False) or not hasattr(model, "num_classes")  # (timm's FeatureListNet)
    info = getattr(model, "feature_info", None)
    if pyramid and info is not None:  # timm's FeatureInfo lists every stage; channels() the maps returned
        return [f"features_{i}" for i in range(len(info.channels() if hasattr(info, "channels") else info))]
    return ["logits" if getattr(model, "num_classes", 1) else "features"]


def external_locations(path: Path) -> list[str]:
    """The external data files the ONNX model at ``path`` refers to (relative to its folder)."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    tensors = [*proto.graph.initializer, *(a.t for n in proto.graph.node for a in n.attribute if a.HasField("t"))]
    found = [
        next(e.value for e in t.external_data if e.key == "location")
        for t in tensors
        if t.data_location == onnx.TensorProto.EXTERNAL
    ]
    return list(dict.fromkeys(found))
