"""Parameter and FLOP summaries of registered models, and the comparison with the papers' tables.

Models are built on the meta device, so even LambdaResNet-420 is summarised in about a second without allocating
its weights. FLOPs: ``torch.utils.flop_counter`` (2 per multiply-add), one image at the default input size.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from lambdanet.models.paper_tables import PAPER_ROWS, PaperRow
from lambdanet.models.factory import create_model
from lambdanet.models.registry import list_models, model_info
from lambdanet.runtime import count_flops

__all__ = ["model_summary", "summarize_models", "paper_comparison", "markdown_table"]


def model_summary(name: str, img_size: int | None = None, *, flops: bool = True, **kwargs) -> dict:
    """``{"model", "params", "flops", "input_size"}`` of ``create_model(name, **kwargs)`` (a model that takes no
    image, ``ModelInfo.input_size`` 0 such as a language model: parameters only, ``flops`` and ``input_size``
    ``None``)."""
    image = model_info(name).input_size > 0
    size = img_size or model_info(name).input_size if image else None
    with torch.device("meta"):
        model = create_model(name, **kwargs).eval()
        params = sum(p.numel() for p in model.parameters())
        side = cast(int, size)  # an image model's (the only ones whose FLOPs are counted)
        total = count_flops(lambda: model(torch.empty(1, 3, side, side))) if flops and image else None
    return {"model": name, "params": params, "flops": total, "input_size": size}


def summarize_models(pattern: str | None = None, *, flops: bool = True) -> list[dict]:
    """:func:`model_summary` of every registered model matching ``pattern``."""
    return [model_summary(name, flops=flops) for name in list_models(pattern)]


def paper_comparison(rows: list[PaperRow] | None = None, *, flops: bool = True) -> list[dict]:
    """Each paper row with our parameter count (and FLOPs where the paper reports them)."""
    out = []
    for row in rows if rows is not None else PAPER_ROWS:
        entry: dict[str, Any] = {
            "table": row.table,
            "row": row.row,
            "call": row.call,
            "paper_params_m": row.params_m,
            "paper_flops_g": row.flops_g,
            "note": row.note,
        }
        if row.model:
            s = model_summary(row.model, row.image_size, flops=flops and row.flops_g is not None, **row.kwargs)
            entry["params_m"] = s["params"] / 1e6
            entry["flops_g"] = s["flops"] / 1e9 if s["flops"] is not None else None
            if row.params_m:
                entry["delta"] = entry["params_m"] / row.params_m - 1
        out.append(entry)
    return out


def markdown_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """Render ``rows`` as a Markdown table with ``(key, header)`` columns (floats with 2 decimals)."""

    def fmt(v):
        return "-" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v).replace("|", "\\|")

    lines = ["| " + " | ".join(h for _, h in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(k)) for k, _ in columns) + " |" for r in rows]
    return "\n".join(lines)
