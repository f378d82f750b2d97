"""Python blocks of the guides run as written (an audit that ran every block found some that did not), and what
their comments say is what they give. Blocks that need the network, a GPU or minutes of training are left to the
audit; the ones here are self-contained and take seconds."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

DOCS = Path(__file__).resolve().parents[1] / "docs"


def block(page: str, anchor: str) -> str:
    """The one ```python block of ``docs/<page>`` that contains ``anchor``."""
    blocks = [b for b in re.findall(r"```python\n(.*?)```", (DOCS / page).read_text(), re.S) if anchor in b]
    assert len(blocks) == 1, f"{page}: {len(blocks)} python blocks contain {anchor!r}"
    return blocks[0]


def run(page: str, anchor: str) -> dict:
    ns: dict = {}
    exec(compile(block(page, anchor), f"docs/{page}", "exec"), ns)
    return ns


def test_the_timm_interface_block_of_models_md_runs_and_gives_its_comments():
    pytest.importorskip("timm")
    ns = run("models.md", "forward_intermediates")
    assert ns["m"].feature_info.channels() == [64, 512, 2048] and ns["m"].feature_info.reduction() == [2, 8, 32]
    assert len(ns["maps"]) == 2 and ns["final"].shape[1] == 2048
    fresh = ns["lambdanet"].create_model("lambda_resnet26t")
    assert "stages.2.1.self_attn.embedding.weight" in fresh.no_weight_decay()
    assert fresh.prune_intermediate_layers((1, 2)) == [1, 2]


def test_the_impl_tuning_block_of_lambda_layer_md_runs(tmp_path, monkeypatch):
    from lambdanet.layers import clear_impl_cache, set_impl_cache_file, set_impl_tuning
    from lambdanet.layers.lambda_layer import _IMPLS

    monkeypatch.setenv("HOME", str(tmp_path))  # its cache file goes under ~/.cache
    try:
        ns = run("lambda_layer.md", "auto_choice(layer, x)")
        assert ns["auto_choice"](ns["layer"], ns["x"]) in _IMPLS
    finally:
        set_impl_tuning(None)
        set_impl_cache_file(None)
        clear_impl_cache()
    assert torch.is_tensor(ns["x"])


def test_the_pretrained_cfg_keys_pretrained_md_names_exist():
    """Its block downloads weights (not run here); the keys its comment names are the model's own."""
    from lambdanet import create_model

    (line,) = [ln for ln in block("pretrained.md", "model.pretrained_cfg").splitlines() if "pretrained_cfg  " in ln]
    named = [k.strip() for k in line.split("#", 1)[1].split(",")]
    assert len(named) >= 5 and set(named) <= set(create_model("lambda_resnet26t").pretrained_cfg)
