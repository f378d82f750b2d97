"""Runs written by an earlier lambdanet (``tests/fixtures/runs_v1``, made by ``make_runs_v1.py`` with the code
before the single training engine) still load and resume.

A resumed old run is compared with the same run made, stopped and resumed by this version (whose resume is
exact: ``test_preempt.py``), so the two agree only if the old files are read as this version's own are.
Both do the same operations on the same data in the same order; the only difference is that the old run's
first steps ran on the machine that made the fixture, whose float32 reductions may be ordered otherwise
(AVX2 vs AVX-512): a relative difference of a few 2^-24 per reduction, some 1e-6 of the weights after the
few steps taken here. Reading a piece of the old state wrongly differs by far more (measured by skipping
it only for the old files): the SGD momentum 2e-3 of the weights, the EMA 0.2, and the wrong RNG state or
data position changes the batch altogether. ``RTOL`` = 1e-4 sits between the two.
"""

import csv
import json
import importlib.util
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lambdanet.cli import main

FIXTURES = Path(__file__).resolve().parent / "fixtures"
RUNS = FIXTURES / "runs_v1"
RTOL = 1e-4

_spec = importlib.util.spec_from_file_location("make_runs_v1", FIXTURES / "make_runs_v1.py")
make = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make)


def copy_run(name: str, tmp_path: Path, runs: Path = RUNS) -> Path:
    out = tmp_path / name
    shutil.copytree(runs / name, out)
    return out


def relative_difference(a: dict, b: dict) -> float:
    """``||a - b|| / ||b||`` over every floating-point tensor of two state dicts with the same keys."""
    assert a.keys() == b.keys()
    keys = [k for k in b if b[k].is_floating_point()]
    diff = sum(float((a[k].double() - b[k].double()).square().sum()) for k in keys)
    norm = sum(float(b[k].double().square().sum()) for k in keys)
    return (diff / norm) ** 0.5


def metrics_rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def stopped_run(args: list[str], out: Path, stop_after: int) -> Path:
    with make.sigterm_after_step(stop_after):
        assert main([*args, "--out", str(out)]) == 143
    return out


def test_a_stopped_v1_train_run_resumes_to_the_weights_of_this_version(tmp_path, capsys):
    old = copy_run("train", tmp_path)
    new = stopped_run(make.TRAIN, tmp_path / "new", stop_after=5)
    capsys.readouterr()
    assert main(["train", "--out", str(old), "--resume", "--no-progress"]) == 0
    assert "1/2 epochs done, epoch 2 from batch 3" in capsys.readouterr().out
    assert main(["train", "--out", str(new), "--resume", "--no-progress"]) == 0
    for name in ("model.safetensors", "model_ema.safetensors"):
        assert relative_difference(load_file(old / name), load_file(new / name)) < RTOL, name
    saved = metrics_rows(RUNS / "train" / "metrics.csv")
    rows = metrics_rows(old / "metrics.csv")
    assert [r["epoch"] for r in rows] == ["1", "2"] and rows[0] == saved[0]  # epoch 1's row kept as written
    # best-epoch weights: the stopped checkpoint is mid-epoch 2, so it does not hold epoch 1's weights; the run ends
    # with the best epoch's own weights (epoch 2: the final ones) or none, never epoch 2's labelled epoch 1
    best = json.loads((old / "summary.json").read_text())["best_epoch"]
    for name in ("model_best.safetensors", "model_best_ema.safetensors"):
        if best == 2:
            final = "model.safetensors" if name == "model_best.safetensors" else "model_ema.safetensors"
            assert relative_difference(load_file(old / name), load_file(old / final)) == 0, name
        else:
            assert not (old / name).exists(), name


def test_a_finished_v1_train_run_loads_and_fine_tunes(tmp_path, capsys):
    from lambdanet import load_model

    run = RUNS / "train_done"
    model = load_model(run)  # a run directory: its EMA weights
    weights = load_file(run / "model_ema.safetensors")
    state = model.state_dict()
    assert set(weights) <= set(state)
    for key, tensor in weights.items():  # loading is copying: bit for bit
        assert torch.equal(state[key], tensor), key
    assert main(["eval", "--checkpoint", str(run), "--json"]) == 0
    assert '"epoch": 1' in capsys.readouterr().out
    out = tmp_path / "tuned"
    assert main(["train", "--checkpoint", str(run), "--epochs", "1", "--max-train-batches", "1", "--batch-size", "8",
                 "--no-progress", "--no-tensorboard", "--out", str(out)]) == 0
    assert (out / "model.safetensors").is_file()


@pytest.mark.parametrize("name, stop_after, printed", [
    ("detect", 4, "0/2 epochs done, epoch 1 from batch 2"),
    ("detect_pretrain", 2, "2/3 steps done"),
])
def test_a_stopped_v1_detect_run_resumes_to_the_weights_of_this_version(tmp_path, capsys, name, stop_after, printed):
    pytest.importorskip("pycocotools")
    old = copy_run(name, tmp_path)
    new = stopped_run(make.DETECT, tmp_path / "new", stop_after=stop_after)
    capsys.readouterr()
    assert main(["detect", "--out", str(old), "--resume"]) == 0
    assert printed in capsys.readouterr().out
    assert main(["detect", "--out", str(new), "--resume"]) == 0
    assert relative_difference(load_file(old / "model.safetensors"), load_file(new / "model.safetensors")) < RTOL


# language-model runs written before lambda_lm_<size> took its short convolution (tests/fixtures/lm_runs_v02)
LM_RUNS = FIXTURES / "lm_runs_v02"
_lm_spec = importlib.util.spec_from_file_location("make_lm_runs_v02", FIXTURES / "make_lm_runs_v02.py")
make_lm = importlib.util.module_from_spec(_lm_spec)
_lm_spec.loader.exec_module(make_lm)


def copy_lm_run(name: str, tmp_path: Path, runs: Path = LM_RUNS) -> Path:
    """The fixture run ``name`` copied, its ``config.yaml`` naming the corpus of this checkout: the fixture
    names the corpus where it was made (another folder on CI), as a run moved with its data would."""
    import yaml

    out = copy_run(name, tmp_path, runs=runs)
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert config["data"].endswith("/tests/fixtures/lm_corpus.txt")  # the fixture's data is the corpus
    (out / "config.yaml").write_text(yaml.safe_dump(config | {"data": f"text:{make_lm.CORPUS}"}, sort_keys=False))
    return out


def test_a_language_model_written_before_the_default_moved_loads_as_the_plain_model_it_trained():
    """Its options do not say ``short_conv``: it is ``plain_lambda_lm_nano`` (no convolution weights), loaded
    strictly and bit for bit, from its weights and from its checkpoint; the default model would not even load."""
    from lambdanet.models import create_model
    from lambdanet.tasks.lm import load_lm

    weights = load_file(LM_RUNS / "lm_done" / "model.safetensors")
    model = load_lm(LM_RUNS / "lm_done")
    assert model.model_name == "plain_lambda_lm_nano" and model.lm_cfg["model"] == "plain_lambda_lm_nano"
    state = model.state_dict()
    assert state.keys() == weights.keys() and all(torch.equal(state[k], weights[k]) for k in weights)
    assert load_lm(LM_RUNS / "lm" / "last.pt").model_name == "plain_lambda_lm_nano"
    with pytest.raises(RuntimeError, match="Missing key"):
        create_model("lambda_lm_nano").load_state_dict(weights)  # the new default has the convolution


def test_a_stopped_language_model_run_of_the_old_default_resumes_to_the_weights_of_this_version(tmp_path, capsys):
    """Resumed, it trains the plain model it started (and says so in its configuration); the same run made,
    stopped and resumed by this version with ``plain_lambda_lm_nano`` ends with the same weights (``RTOL``)."""
    from lambdanet.engine.config import load_yaml

    old = copy_lm_run("lm", tmp_path)
    args = [a if a != "lambda_lm_nano" else "plain_lambda_lm_nano" for a in make_lm.LM]
    new = stopped_run(args, tmp_path / "new", stop_after=3)
    capsys.readouterr()
    assert main(["lm", "train", "--out", str(old), "--resume"]) == 0
    assert main(["lm", "train", "--out", str(new), "--resume"]) == 0
    saved = load_yaml(old / "config.yaml")
    assert saved["model"] == "plain_lambda_lm_nano" and saved["model_kwargs"] == {}
    assert relative_difference(load_file(old / "model.safetensors"), load_file(new / "model.safetensors")) < RTOL


# language-model runs written while lambda_lm_<size>'s default was the short convolution alone (before its decay;
# tests/fixtures/lm_runs_conv), and under today's default, the convolution with the fixed decay (which must keep
# loading once the default moves; tests/fixtures/lm_runs_fixed): the same command as lm_runs_v02. Each: the
# fixture, the options its runs read back with (what this version's run of the same model is given), the layer's
# (short_conv, decay, heads, dim_v), and why today's default refuses its weights (None: they are its own)
LATER_RUNS = [
    pytest.param(FIXTURES / "lm_runs_conv", {"short_conv": 4, "dim_v": 64, "decay": None},
                 (4, None, 2, 64), "Missing key.*decay_rate", id="convolution"),
    pytest.param(FIXTURES / "lm_runs_fixed", {"short_conv": 4, "decay": "fixed", "dim_v": 64},
                 (4, "fixed", 2, 64), None, id="fixed_decay"),
]  # fmt: skip


@pytest.mark.parametrize(("runs", "kwargs", "layer", "refused"), LATER_RUNS)
def test_a_language_model_of_a_later_default_loads_as_the_model_it_trained(runs, kwargs, layer, refused):
    """Its options say what its default set (the convolution's lack ``decay``): ``lambda_lm_nano`` as it was then
    (no decay rates for the convolution alone), loaded strictly and bit for bit, from its weights and from its
    checkpoint. Today's default model would not load the convolution's weights (no decay rates); those of the
    fixed decay are its own: they load and give the run's outputs."""
    from lambdanet.models import create_model
    from lambdanet.tasks.lm import load_lm

    weights = load_file(runs / "lm_done" / "model.safetensors")
    for path in (runs / "lm_done", runs / "lm" / "last.pt"):
        model = load_lm(path)
        assert model.model_name == "lambda_lm_nano" and model.lm_cfg["model_kwargs"] == kwargs
        mixer = model.blocks[0].mixer
        assert (mixer.short_conv, mixer.decay, mixer.heads, mixer.dim_v) == layer
    model = load_lm(runs / "lm_done")
    state = model.state_dict()
    assert state.keys() == weights.keys() and all(torch.equal(state[k], weights[k]) for k in weights)
    default = create_model("lambda_lm_nano").eval()
    if refused is not None:
        with pytest.raises(RuntimeError, match=refused):
            default.load_state_dict(weights)
        return
    default.load_state_dict(weights)
    x = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model.eval()(x), default(x))


@pytest.mark.parametrize(("runs", "kwargs", "layer", "refused"), LATER_RUNS)
def test_a_stopped_language_model_run_of_a_later_default_resumes_to_the_weights_of_this_version(
    runs, kwargs, layer, refused, tmp_path, capsys
):
    """Resumed, it trains the model it started (the convolution's configuration now says ``decay: null``); the
    same run made, stopped and resumed by this version with those options ends with the same weights (``RTOL``)."""
    import yaml

    from lambdanet.engine.config import load_yaml

    old = copy_lm_run("lm", tmp_path, runs=runs)
    given = ["--model-kwargs", yaml.safe_dump(kwargs, default_flow_style=True).strip()]
    new = stopped_run([*make_lm.LM, *given], tmp_path / "new", stop_after=3)
    capsys.readouterr()
    assert main(["lm", "train", "--out", str(old), "--resume"]) == 0
    assert main(["lm", "train", "--out", str(new), "--resume"]) == 0
    saved = load_yaml(old / "config.yaml")
    assert saved["model"] == "lambda_lm_nano"
    assert saved["model_kwargs"] == kwargs == load_yaml(new / "config.yaml")["model_kwargs"]
    assert relative_difference(load_file(old / "model.safetensors"), load_file(new / "model.safetensors")) < RTOL
