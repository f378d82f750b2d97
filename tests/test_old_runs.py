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

import contextlib
import copy
import csv
import json
import math
import importlib.util
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.optim.optimizer import register_optimizer_step_post_hook

from lambdanet.cli import main
from lambdanet.engine.checkpoint import rng_state, unwrap
from lambdanet.engine.state import RunState

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


def test_a_v1_train_run_resumed_with_checkpoint_steps_counts_the_runs_steps(tmp_path, power_cut):
    """A v1 checkpoint kept no step count (epoch 1 of 3 steps and 2 of epoch 2 done: 5 steps); ``--checkpoint-steps
    3`` saves at the run's 6th step (epoch 2's last), as it does in a run of this version, not 3 steps after the
    resume (the count started again from 0)."""
    from lambdanet.engine.checkpoint import load_checkpoint

    old = copy_run("train", tmp_path)
    with power_cut(2), pytest.raises(RuntimeError, match="power cut"):
        main(["train", "--out", str(old), "--resume", "--no-progress", "--epochs", "3", "--checkpoint-steps", "3",
              "--checkpoint-every", "5"])  # fmt: skip
    saved = load_checkpoint(old / "last.pt")  # the epochs' ends unsaved; the power cut after the run's 7th step
    assert (saved["epoch"], saved.get("step"), saved["epoch_partial"]["batches"]) == (1, 6, 3)


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


def adam_flip_bound(lrs: list[float], weights: dict[str, torch.Tensor]) -> float:
    """The most two correct runs of the same detection training on two machines can differ by, relative to the
    weights, after Adam steps at the rates ``lrs``.

    The detection losses are discontinuous in the weights (anchors and proposals are chosen by IoU thresholds,
    top-k and sampling), and many gradients are near zero (some exactly so but for rounding), so the machines'
    float32 reorderings flip the sign of some gradient elements, and Adam moves an element by ``lr`` times
    ``m / sqrt(v)`` whatever its gradient's size. With the bias corrections, Cauchy-Schwarz gives
    ``|m / sqrt(v)| <= sqrt(sum_s w_s^2 / u_s)`` (``w_s``, ``u_s``: the weights of step ``s``'s gradient in the
    two moments), which is at most 1.02 for the first 8 steps at betas (0.9, 0.999) (1.1 taken); so each step
    moves two runs' element apart by at most ``2.2 lr``, and ``n`` elements by ``2.2 lr sqrt(n)``. (Weight decay
    1e-4 adds 1e-4 lr |w|: nothing here.)
    """
    params = [v for v in weights.values() if v.is_floating_point()]
    norm = math.sqrt(sum(float(v.double().square().sum()) for v in params))
    return 2.2 * sum(lrs) * math.sqrt(sum(v.numel() for v in params)) / norm


@contextlib.contextmanager
def loads_recorded():
    """Every :class:`RunState` the block loads from a checkpoint, as it stands right after the load: the model's
    state, the optimiser's, the counters and the random generators (copies)."""
    loaded, original = [], RunState.load_state_dict

    def load_state_dict(self, state):
        original(self, state)
        loaded.append(copy.deepcopy({
            "model": unwrap(self.model).state_dict(), "optimizer": self.optimizer.state_dict(),
            "epoch": self.epoch, "step": self.step,
            "rng": rng_state(), "file": state,
        }))

    RunState.load_state_dict = load_state_dict
    try:
        yield loaded
    finally:
        RunState.load_state_dict = original


@contextlib.contextmanager
def rates_recorded():
    """The learning rate of every optimiser step taken in the block (its largest over parameter groups)."""
    rates = []
    handle = register_optimizer_step_post_hook(lambda opt, a, k: rates.append(max(g["lr"] for g in opt.param_groups)))
    try:
        yield rates
    finally:
        handle.remove()


def adam_moments(optimizer_state: dict, name: str) -> dict:
    return {str(key): state[name] for key, state in optimizer_state["state"].items()}


@pytest.mark.parametrize("name, stop_after, printed", [
    ("detect", 4, "0/2 epochs done, epoch 1 from batch 2"),
    ("detect_pretrain", 2, "2/3 steps done"),
])
def test_a_stopped_v1_detect_run_resumes_to_the_weights_of_this_version(tmp_path, capsys, name, stop_after, printed):
    """What the resume of an old detection run reads equals what this version's own run holds at the same stop,
    and the two finish within :func:`adam_flip_bound` of each other.

    Unlike classification, the two runs' weights cannot be held to ``RTOL``: the fixture's steps ran on another
    machine, and its float32 reorderings flip near-zero gradients that Adam turns into whole ``lr`` steps (this
    machine and the fixture's: 1e-4 of the weights at the end; the bound, 2e-3). A state read wrongly can hide
    under that (measured here: no optimiser state 4e-4, first moments zeroed 3e-4, Adam's step counts reset
    1.5e-4, another RNG state 2.6e-4), so the read state is checked where it is read: at the load, before the
    first resumed step. There the counters and Adam's step counts equal this version's exactly, the RNG states
    are the file's own, and the moments differ by the gradient the fixture's machine took: each loss averages
    over 64 sampled anchors or proposals, one sampled otherwise changes the gradient by some 1/64, so 0.5 allows
    some 30 of them while moments read wrongly differ by at least 1 (zeros: 1; another parameter's: ~sqrt(2)).
    """
    pytest.importorskip("pycocotools")
    old = copy_run(name, tmp_path)
    with rates_recorded() as before:
        new = stopped_run(make.DETECT, tmp_path / "new", stop_after=stop_after)
    capsys.readouterr()
    with loads_recorded() as old_loads:
        assert main(["detect", "--out", str(old), "--resume"]) == 0
    assert printed in capsys.readouterr().out
    with loads_recorded() as new_loads, rates_recorded() as after:
        assert main(["detect", "--out", str(new), "--resume"]) == 0
    # every step of this version's run (pre-training and detection, before and after its stop): at most 2.2 lr
    # apart per element while each optimiser is within its first 8 steps
    assert len(before) + len(after) <= 8
    weights = load_file(new / "model.safetensors")
    bound = adam_flip_bound(before + after, weights) + RTOL
    assert bound < 1e-2  # still far below what the weights of another step or run differ by

    (o,), (n,) = old_loads, new_loads  # one load each: the interrupted pass's own checkpoint
    assert (o["epoch"], o["step"]) == (n["epoch"], n["step"])  # and where the pass goes on: ``printed``
    read, saved = o["rng"], o["file"]["rng"]  # the old run's own generators, however this version stores them
    assert read["python"] == saved["python"] and torch.equal(read["torch"], saved["torch"])
    assert relative_difference(o["model"], n["model"]) < bound
    old_opt, new_opt = o["optimizer"], n["optimizer"]
    assert old_opt["state"].keys() == new_opt["state"].keys() and len(old_opt["state"]) > 0
    for key in new_opt["state"]:
        assert float(old_opt["state"][key]["step"]) == float(new_opt["state"][key]["step"]) > 0, key
    for moment in ("exp_avg", "exp_avg_sq"):
        assert relative_difference(adam_moments(old_opt, moment), adam_moments(new_opt, moment)) < 0.5, moment

    assert relative_difference(load_file(old / "model.safetensors"), weights) < bound


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


def test_a_detect_run_written_before_glyphs_existed_resumes_on_the_auto_sets_it_trained_on(tmp_path):
    """0.1.0 had no ``--glyphs``: its scenes were always the ``auto`` sets. A saved ``config.yaml`` without the
    key is that, not today's default (``digits``): the run resumes on its own scenes, and ``--glyphs auto`` is no
    change; a run that records its glyphs keeps them."""
    import yaml

    from lambdanet.engine.config import load_run_yaml
    from lambdanet.tasks.detection.config import DetectConfig
    from lambdanet.tasks.detection.glyphs import DEFAULT_GLYPHS

    assert DEFAULT_GLYPHS != "auto"  # else the test shows nothing
    out = copy_run("detect", tmp_path)
    saved = load_run_yaml(out / "config.yaml")
    assert DetectConfig.resolve(overrides={"out": str(out), "resume": True}).glyphs == saved["glyphs"]
    del saved["glyphs"]
    (out / "config.yaml").write_text(yaml.safe_dump(saved))
    cfg = DetectConfig.resolve(overrides={"out": str(out), "resume": True})
    assert cfg.glyphs == "auto" and cfg.check_resume() == saved["epochs"]
    again = DetectConfig.resolve(overrides={"out": str(out), "resume": True, "glyphs": "auto"})
    assert again.check_resume() == saved["epochs"]


def test_a_refused_resume_leaves_the_runs_configuration_as_it_was(tmp_path, capsys):
    """``--resume --epochs N`` below the epochs done is refused, and the run's ``config.yaml`` is not rewritten
    with N first (every later plain ``--resume`` would then be refused too)."""
    out = copy_run("train", tmp_path)
    main(["train", "--out", str(out), "--resume", "--no-progress"])  # the v1 run ends its 2 epochs
    before = (out / "config.yaml").read_bytes()
    capsys.readouterr()
    assert main(["train", "--out", str(out), "--resume", "--epochs", "1"]) == 2
    assert "--epochs 1 is fewer than the 2 epochs" in capsys.readouterr().err
    assert (out / "config.yaml").read_bytes() == before
    assert main(["train", "--out", str(out), "--resume", "--no-progress"]) == 0
