"""The language-model ablation study's harness (lambdanet/bench/lm_ablation.py, issue 37): every configuration at
the transformer's parameter budget, a study that resumes where it stopped, and its summary."""

import json

import pytest

from lambdanet.bench import lm_ablation
from lambdanet.bench.lm_ablation import ABLATIONS, BUDGET_TOLERANCE, matched_kwargs, study, summarize
from lambdanet.models import create_model


@pytest.mark.parametrize("config", list(ABLATIONS))
def test_every_configuration_is_within_the_budget_and_keeps_its_options(config):
    family, kwargs = ABLATIONS[config]
    options, params, reference = matched_kwargs(family, "tiny", kwargs)
    assert abs(params / reference - 1) <= BUDGET_TOLERANCE, (config, params, reference)
    assert {k: v for k, v in options.items() if k != "dim_v"} == kwargs  # dim_v is the only knob it turns
    model = create_model(f"{family}_lm_tiny", **options)
    assert sum(p.numel() for p in model.parameters()) == params  # counted on the model that trains


@pytest.mark.parametrize("config", ["heads8", "gate_conv4", "hybrid"])
def test_the_dim_v_bisection_finds_what_trying_every_value_finds(config):
    """``matched_kwargs`` bisects over ``dim_v`` (the count grows with it): the same value and count as trying every
    multiple of 8 up to ``4 dim``, as the study did before (nano: 32 models)."""
    from lambdanet.bench.lm_ablation import _closest_dim_v, _params
    from lambdanet.models.lm import LM_SIZES

    family, kwargs = ABLATIONS[config]
    name, reference, dim = f"{family}_lm_nano", _params("transformer_lm_nano", {}), LM_SIZES["nano"].dim
    counts = {v: _params(name, {**kwargs, "dim_v": v}) for v in range(8, 4 * dim + 1, 8)}
    best = min(counts, key=lambda v: abs(counts[v] - reference))
    assert _closest_dim_v(name, kwargs, reference, dim) == (best, counts[best])


def test_the_knobs_turn_the_plain_layer_and_the_chosen_one_is_the_registered_default():
    """The study's reference ``lambda`` is the paper's layer alone whatever the registered default is (rows written
    before the default moved keep their meaning), and ``fixed_conv4``, the default it chose, builds exactly the tiny
    model ``lambda_lm_tiny`` now is; ``short_conv4``, the default before, is ``lambda_lm_tiny`` with ``decay=None``,
    ``fixed_conv4_heads8`` (best at the study's budget, not the default: docs/language_models.md) with
    ``heads=8``, and ``fixed_conv4_u2`` with ``dim_u=2`` (its value depth matched down to 64)."""
    import torch

    assert ABLATIONS["lambda"] == ("plain_lambda", {})
    assert all(family != "lambda" for family, _ in ABLATIONS.values())
    for config, default_kwargs in (("fixed_conv4", {}), ("short_conv4", {"decay": None}),
                                   ("fixed_conv4_heads8", {"heads": 8}),
                                   ("fixed_conv4_u2", {"dim_u": 2, "dim_v": 64})):  # fmt: skip
        family, kwargs = ABLATIONS[config]
        options = matched_kwargs(family, "tiny", kwargs)[0]  # builds models: before the seed
        torch.manual_seed(0)
        chosen = create_model(f"{family}_lm_tiny", **options)
        torch.manual_seed(0)
        default = create_model("lambda_lm_tiny", **default_kwargs)
        assert repr(chosen) == repr(default), config
        a, b = chosen.state_dict(), default.state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), config


def test_the_study_writes_each_run_at_once_and_resumes_without_rerunning(tmp_path, monkeypatch):
    calls = []

    def fake_run(name, corpus, context, batch, seed, **kw):  # the training itself is lm_bench's (tested there)
        calls.append((name, seed, kw["model_kwargs"]))
        return {"val_bits_per_byte": 2.0 + seed + (("lambda" in name) * 0.1), "steps": kw["steps"],
                "train_s": 0.0}

    monkeypatch.setattr(lm_ablation, "train_run", fake_run)
    settings = dict(out=tmp_path, size="nano", seeds=(0, 1), steps=3, context=32, batch=2, eval_bytes=64,
                    log=lambda _: None)
    rows = study(["transformer", "lambda"], **settings)
    assert [(c[0], c[1]) for c in calls] == [("transformer_lm_nano", 0), ("plain_lambda_lm_nano", 0),
                                             ("transformer_lm_nano", 1), ("plain_lambda_lm_nano", 1)]
    saved = [json.loads(line) for line in (tmp_path / "lm_ablation.jsonl").read_text().splitlines()]
    assert saved == rows and len(rows) == 4
    calls.clear()
    again = study(["transformer", "lambda", "u2"], **settings)  # the two finished configurations are not rerun
    assert [c[0] for c in calls] == ["plain_lambda_lm_nano", "plain_lambda_lm_nano"] and "dim_v" in calls[0][2]
    assert len(again) == 6
    summary = {r["config"]: r for r in summarize(again)}
    assert summary["lambda"]["seeds"] == 2 and summary["lambda"]["mean_bits_per_byte"] == pytest.approx(2.6)
    assert summary["lambda"]["vs_transformer"] == pytest.approx((2.1 / 2.0 + 3.1 / 3.0) / 2)
    assert summary["transformer"]["std_bits_per_byte"] == pytest.approx(0.5**0.5)  # sample deviation of {2, 3}


def test_an_unknown_configuration_is_a_one_line_error(tmp_path, capsys):
    assert lm_ablation.main(["--configs", "lambda", "wide", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "configs must be among" in err and "'wide'" in err


def test_a_bad_configuration_fails_before_any_run_and_a_cut_line_reruns(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(lm_ablation, "train_run", lambda name, *a, **kw: calls.append(name) or
                        {"val_bits_per_byte": 2.0, "steps": 1, "train_s": 0.0})
    settings = dict(out=tmp_path, size="nano", seeds=(0,), steps=1, context=16, batch=1, eval_bytes=32,
                    log=lambda _: None)
    with pytest.raises(ValueError, match="lambdas must divide heads=2"):  # nano has 2 heads: before any training
        study(["lambda", "lambdas4"], **settings)
    assert calls == []
    study(["lambda"], **settings)
    path = tmp_path / "lm_ablation.jsonl"
    path.write_text(path.read_text() + '{"config": "transformer", "se')  # a crash mid-write
    study(["lambda", "transformer"], **settings)
    assert calls == ["plain_lambda_lm_nano", "transformer_lm_nano"]  # the cut run reruns, the finished one does not
    assert study(["lambda"], **{**settings, "device": "meta"}) and calls[-1] == "plain_lambda_lm_nano"  # another device


def test_two_studies_on_one_folder_share_the_runs_through_claims(tmp_path, monkeypatch):
    """A run another live process has claimed is skipped (and not lost: its row is the other's to write); a claim
    left by a process that is gone is taken over; a finished run leaves no claim."""
    import subprocess
    import sys

    calls = []
    monkeypatch.setattr(lm_ablation, "train_run", lambda name, *a, **kw: calls.append(name) or
                        {"val_bits_per_byte": 2.0, "steps": 1, "train_s": 0.0})  # fmt: skip
    claims = tmp_path / "claims"
    claims.mkdir()
    holder = subprocess.Popen(["sleep", "60"])
    (claims / "transformer-seed0").write_text(str(holder.pid))  # alive: held
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (claims / "lambda-seed0").write_text(gone.stdout.strip())  # that process has exited: a stale claim
    logged = []
    settings = dict(out=tmp_path, size="nano", seeds=(0,), steps=1, context=16, batch=1, eval_bytes=32)
    try:
        rows = study(["transformer", "lambda"], log=logged.append, **settings)
    finally:
        holder.kill()
        holder.wait()
    assert calls == ["plain_lambda_lm_nano"] and [r["config"] for r in rows] == ["lambda"]
    assert any("transformer: running in another process" in line for line in logged)
    assert sorted(p.name for p in claims.iterdir()) == ["transformer-seed0"]


def test_the_summary_table_gives_the_spread_only_over_several_seeds():
    def row(config, seed, bpb):
        return {"config": config, "model_kwargs": {}, "seed": seed, "val_bits_per_byte": bpb,
                "params_vs_transformer": 1.0}  # fmt: skip

    table = lm_ablation.summary_table([row("transformer", 0, 2.0), row("transformer", 1, 2.2), row("lambda", 0, 1.9)])
    lines = {line.split(" | ")[0]: line.split(" | ") for line in table.splitlines()[2:]}
    assert lines["| lambda"][4] == "-" and lines["| lambda"][5] == "0.950"  # paired with seed 0's 2.0
    assert lines["| transformer"][3:5] == ["2.1000", "0.1414"]  # sample standard deviation of 2.0 and 2.2
    old = {**row("fixed_wd", 0, 1.8), "model_kwargs": {"decay": "fixed"}, "rate_weight_decay": True}
    lines = {line.split(" | ")[0]: line.split(" | ") for line in lm_ablation.summary_table([old, row("lambda", 0, 1.9)])
             .splitlines()[2:]}  # fmt: skip
    assert lines["| fixed_wd"][1] == "{'decay': 'fixed'} (rates under weight decay)" and lines["| lambda"][1] == ""
