"""Training and evaluation: recipes, runs, resume after SIGKILL, failures, distributed, sweep, pseudo-labels."""

import csv
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from lambdanet.cli import main
from lambdanet.tasks.classification.data import ImageLoader, build_datasets, epoch_indices
from lambdanet.models import create_model
from lambdanet.models import ModelInfo, register_model, unregister_model
from lambdanet.tasks.classification import TrainingDivergedError, evaluate_checkpoint, resolve_config, train
from lambdanet.engine.checkpoint import CheckpointError, load_checkpoint
from lambdanet.engine.optim import lr_at
from lambdanet.tasks.classification.task import build_model_for

FAST = dict(epochs=2, max_train_batches=3, batch_size=32, progress=False, tensorboard=False)
ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}


def run_cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "lambdanet", *args], capture_output=True, text=True, timeout=timeout,
                          env=ENV)


# --------------------------------------------------------------------------------------------- recipes


def test_step_schedule_and_nesterov():
    # "x0.97 every 2.4 epochs" style: constant within each decay period, the rate to the power of the periods passed
    assert lr_at(10, 100, 10, schedule="step", decay_rate=0.5, decay_steps=4) == 1.0
    assert lr_at(13, 100, 10, schedule="step", decay_rate=0.5, decay_steps=4) == 1.0
    assert lr_at(14, 100, 10, schedule="step", decay_rate=0.5, decay_steps=4) == 0.5
    assert lr_at(30, 100, 10, schedule="step", decay_rate=0.5, decay_steps=4) == 0.5 ** 5
    assert lr_at(90, 100, 10, schedule="step", decay_rate=0.5, decay_steps=4, min_factor=0.01) == 0.01
    from lambdanet.engine.optim import build_optimizer

    cfg = resolve_config(overrides={"optimizer": "sgd", "nesterov": True})
    assert build_optimizer(nn.Linear(2, 2), cfg).defaults["nesterov"] is True


def test_lr_schedule_is_linear_warmup_then_cosine():
    total, warm = 100, 10
    assert lr_at(0, total, warm) == pytest.approx(0.1)
    assert lr_at(9, total, warm) == pytest.approx(1.0)
    assert lr_at(10, total, warm) == pytest.approx(1.0)
    assert lr_at(55, total, warm) == pytest.approx(0.5)  # half-way through the cosine
    assert lr_at(99, total, warm) == pytest.approx(0.5 * (1 + math.cos(89 / 90 * math.pi)))
    assert lr_at(0, total, warm, start_factor=0.2) == pytest.approx(0.2 + 0.8 / 10)


def test_recipes_follow_the_papers():
    p90 = resolve_config("paper90", overrides={"batch_size": 1024})
    assert (p90.optimizer, p90.momentum, p90.weight_decay, p90.warmup_epochs) == ("sgd", 0.9, 1e-4, 5.0)
    assert p90.effective_lr() == pytest.approx(0.1 * 1024 / 256) and p90.ema_decay == 0.9999
    assert p90.bn_momentum == pytest.approx(1e-4) and p90.label_smoothing == 0.1 and p90.schedule == "cosine"
    p350 = resolve_config("paper350", overrides={"model": "lambda_resnet50", "data": "digits"})
    assert p350.weight_decay == 4e-5 and p350.randaugment_layers == 2 and p350.amp == "bf16" and p350.epochs == 350
    # Tables 19-20, LambdaResNet-50 at 160 px: RandAugment 10, dropout 0.2, no stochastic depth; resolved into the
    # configuration itself, so config.yaml says what runs
    assert (p350.img_size, p350.randaugment_magnitude, p350.drop_rate, p350.drop_path_rate) == (160, 10, 0.2, 0.0)
    spec = build_datasets("digits")[0]
    model = build_model_for(p350, spec)
    assert model.head_drop.p == 0.2 and model.img_size == (160, 160)
    rs152 = resolve_config("paper350", overrides={"model": "lambda_resnet152"})
    assert (rs152.img_size, rs152.randaugment_magnitude, rs152.drop_rate, rs152.drop_path_rate) == (256, 15, 0.3, 0.1)
    # explicit options still win over the model's paper values
    mine = resolve_config("paper350", overrides={"model": "lambda_resnet50", "img_size": 128, "drop_rate": 0.0})
    assert (mine.img_size, mine.drop_rate, mine.randaugment_magnitude) == (128, 0.0, 10)
    cifar = resolve_config("cifar_repro")
    assert (cifar.optimizer, cifar.batch_size, cifar.epochs, cifar.data) == ("adam", 128, 90, "cifar10")
    assert cifar.effective_lr() * cifar.warmup_start_factor == pytest.approx(5e-4)  # the report's initial LR
    assert cifar.betas == [0.9, 0.9999]


def test_config_precedence_and_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("recipe: paper90\nepochs: 7\nlr: 0.3\n")
    from lambdanet.engine.config import load_yaml
    cfg = resolve_config(None, load_yaml(path), {"lr": 0.5})
    assert (cfg.recipe, cfg.epochs, cfg.lr, cfg.optimizer) == ("paper90", 7, 0.5, "sgd")
    path.write_text("epochz: 3\n")
    with pytest.raises(ValueError, match="unknown option.*epochz.*valid options"):
        resolve_config(None, load_yaml(path))
    with pytest.raises(ValueError, match="unknown recipe 'paper91'"):
        resolve_config("paper91")
    with pytest.raises(ValueError, match="optimizer must be one of"):
        resolve_config(overrides={"optimizer": "lion"})


# ------------------------------------------------------------------------------------------------ data


def test_datasets_offline_and_sharding_reproduces_single_process_batches():
    spec, train_ds, test_ds = build_datasets("digits")
    assert (len(train_ds), len(test_ds), spec.num_classes, spec.in_chans) == (1438, 359, 10, 1)
    spec5k, tr5k, te5k = build_datasets("mnist5k")
    assert (len(tr5k), len(te5k), tuple(tr5k[0][0].shape)) == (4000, 1000, (1, 28, 28))
    full = ImageLoader(train_ds, spec, 16, train=True, batch_size=8, seed=5)
    ranks = [ImageLoader(train_ds, spec, 16, train=True, batch_size=8, seed=5, rank=r, world=2) for r in range(2)]
    for loader in (full, *ranks):
        loader.set_epoch(3)
    (xf, yf), (x0, y0), (x1, y1) = next(iter(full)), next(iter(ranks[0])), next(iter(ranks[1]))
    assert torch.equal(xf[0::2], x0) and torch.equal(xf[1::2], x1)
    assert torch.equal(yf[0::2], y0) and torch.equal(yf[1::2], y1)
    batches = epoch_indices(10, 0, 1, shuffle=True, batch_size=4, drop_last=True)
    assert len(batches) == 2 and len(set(sum(batches, []))) == 8


@pytest.mark.skipif(not Path("/usr/share/datasets/fashion-mnist").exists(),
                    reason="dataset-fashion-mnist not installed")
def test_fashion_mnist_from_the_debian_package():
    spec, train_ds, test_ds = build_datasets("fashion-mnist", download=False)
    assert (len(train_ds), len(test_ds)) == (60000, 10000)
    assert sorted(set(train_ds.labels.tolist())) == list(range(10))
    # the label names, in torchvision's order (label 6 is a shirt, 9 an ankle boot), which predict prints
    from torchvision.datasets import FashionMNIST

    assert spec.classes == FashionMNIST.classes and spec.classes[6] == "Shirt"


def test_runs_of_built_in_datasets_name_their_classes_even_when_written_before_the_names_were_kept():
    """Weights of a fashion-mnist or cifar10 run written without class names (lambdanet <= this change) are
    labelled with the dataset's names; other data, or another number of classes, keep the label numbers."""
    from lambdanet.models.registry import run_image_cfg

    meta = {"model": "resnet26", "num_classes": 10, "in_chans": 1, "image_size": 28, "mean": [0.3], "std": [0.4],
            "classes": None, "data": "fashion-mnist"}  # fmt: skip
    assert run_image_cfg(meta)["classes"][9] == "Ankle boot"
    assert run_image_cfg({**meta, "data": "cifar10", "in_chans": 3})["classes"][0] == "airplane"
    assert run_image_cfg({**meta, "data": "digits"})["classes"] is None
    assert run_image_cfg({**meta, "num_classes": 5})["classes"] is None
    assert run_image_cfg({**meta, "classes": list("abcdefghij")})["classes"][0] == "a"



def test_cifar100s_class_names_come_from_its_files(monkeypatch):
    """CIFAR-100's hundred names are read with its files (torchvision's ``classes``) into the run's spec."""
    import types

    import numpy as np

    from lambdanet.tasks.classification import datasets

    names = [f"class{i}" for i in range(100)]
    fake = types.SimpleNamespace(data=np.zeros((4, 32, 32, 3), np.uint8), targets=[0, 1, 2, 99], classes=names)
    images = datasets._from_torchvision(fake)
    assert images.classes == names and images.images.shape == (4, 3, 32, 32)
    monkeypatch.setattr(datasets, "_cifar", lambda name, data_dir, download: (images, images))
    assert datasets.build_datasets("cifar100", download=False)[0].classes == names
    assert datasets.dataset_spec("cifar100").classes is None  # the static spec has none: nothing read yet


# ------------------------------------------------------------------------------------------------ runs


def test_training_run_writes_every_output_and_eval_agrees(tmp_path):
    out = tmp_path / "run"
    summary = train(resolve_config(overrides={**FAST, "out": str(out), "tensorboard": True, "ema_decay": 0.9}))
    for key in ("model", "best_acc", "final_acc", "epochs", "train_time_s", "images_per_s", "params"):
        assert key in summary
    assert 0.0 <= summary["final_acc"] <= 1.0 and 0.0 <= summary["best_acc"] <= 1.0 and summary["epochs"] == 2
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk["final_acc"] == summary["final_acc"] and on_disk["params"] == summary["params"]
    rows = (out / "metrics.csv").read_text().strip().splitlines()
    assert len(rows) == 3 and rows[0].startswith("epoch,lr,train_loss")
    for name in ("loss.png", "accuracy.png", "config.yaml", "last.pt", "model.safetensors", "model_ema.safetensors"):
        assert (out / name).exists(), name
    assert list((out / "tb").glob("events.out.tfevents.*"))
    # the EMA weights reproduce the reported accuracy through `lambdanet eval`
    res = evaluate_checkpoint(out / "last.pt")
    assert res["top1"] == pytest.approx(summary["final_acc"]) and res["weights"] == "ema"
    model = create_model("lambda_resnet26", num_classes=10, in_chans=1, **summary["model_kwargs"])
    model.load_state_dict(load_file(out / "model_ema.safetensors"))
    assert sum(p.numel() for p in model.parameters()) == summary["params"]


def test_eval_cli(tmp_path, capsys):
    out = tmp_path / "run"
    summary = train(resolve_config(overrides={**FAST, "epochs": 1, "out": str(out)}))
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(out / "last.pt"), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["top1"] == pytest.approx(summary["final_acc"]) and res["samples"] == 359


def test_a_compile_mode_without_compile_is_a_warning_and_compiles_nothing(tmp_path, monkeypatch):
    """``--compile-mode reduce-overhead`` alone compiles nothing (``--compile`` turns compilation on); the run says
    so in one warning line before training, and trains uncompiled."""
    seen = []
    monkeypatch.setattr(torch, "compile", lambda model, **kw: seen.append(kw) or model)
    lines = []
    train(resolve_config(overrides={**FAST, "epochs": 1, "warmup_epochs": 0, "compile_mode": "reduce-overhead",
                                    "out": str(tmp_path)}),
          log=lines.append)  # fmt: skip
    warnings = [line for line in lines if line.startswith("warning:")]
    assert warnings == ["warning: --compile-mode reduce-overhead has no effect without --compile"] and seen == []
    lines.clear()
    train(resolve_config(overrides={**FAST, "epochs": 1, "warmup_epochs": 0, "out": str(tmp_path / "plain")}),
          log=lines.append)
    assert not any(line.startswith("warning:") for line in lines)


def test_checkpoint_steps_save_inside_the_epoch_and_a_crash_resumes_to_the_uninterrupted_weights(tmp_path,
                                                                                                   power_cut):
    """``--checkpoint-steps N``: last.pt is also written at every N-th optimiser step of the run (as a signal
    writes it, the epochs' ends crossed), so a process dying without warning loses fewer than N steps, whatever
    ``--checkpoint-every`` is; the resumed run ends with the uninterrupted run's weights, bit for bit. (0, the
    default: only the epochs' ends, as before.) Epochs of 3 steps; the power cut comes after step 5."""
    run = {**FAST, "epochs": 2, "max_train_batches": 3, "warmup_epochs": 0}
    whole = train(resolve_config(overrides={**run, "out": str(tmp_path / "whole")}))
    # (N, --checkpoint-every, the step last.pt holds, epoch 2's batches in it): N 1 saves every step; N 2 with
    # epoch ends unsaved saves steps 2 and 4 (epoch 1's 2nd, epoch 2's 1st); 0 the end of epoch 1 (step 3)
    for steps, every, saved_step, batches in ((1, 1, 4, 1), (2, 2, 4, 1), (0, 1, 3, None)):
        out = tmp_path / f"cut{steps}"
        with power_cut(5), pytest.raises(RuntimeError, match="power cut"):
            train(resolve_config(overrides={**run, "checkpoint_steps": steps, "checkpoint_every": every,
                                            "out": str(out)}))  # fmt: skip
        saved = load_checkpoint(out / "last.pt")
        assert (saved["epoch"], saved["step"]) == (1, saved_step), steps
        assert (saved["epoch_partial"] or {}).get("batches") == batches, steps
        summary = train(resolve_config(overrides={"out": str(out), "resume": True}))
        assert summary["final_acc"] == whole["final_acc"]
        a, b = load_file(tmp_path / "whole" / "model.safetensors"), load_file(out / "model.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), steps
    with pytest.raises(ValueError, match=r"^checkpoint_steps must be a non-negative int \(0: at the epochs' ends"):
        resolve_config(overrides={"checkpoint_steps": -1})


def test_resume_with_the_epochs_done_refuses_a_checkpoint_inside_the_next_epoch(tmp_path, power_cut, capsys):
    """``--resume --epochs E`` where last.pt is E epochs and some steps of epoch E + 1 (a step save, a signal) ended the
    run at once: its weights held those steps, its summary reported epoch E's figures (another model's) and said it
    was "extending the run from 3 to 1 epochs". It is refused in one line; fewer epochs say they shorten the run."""
    out = tmp_path / "run"
    with power_cut(6), pytest.raises(RuntimeError, match="power cut"):  # last.pt after step 5: epoch 2's 2nd batch
        train(resolve_config(overrides={**FAST, "epochs": 3, "checkpoint_steps": 1, "out": str(out)}))
    kept = (out / "last.pt").read_bytes()
    capsys.readouterr()
    assert main(["train", "--resume", "--out", str(out), "--epochs", "1", "--no-progress"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"lambdanet train: error: --epochs 1 is fewer than {out} has trained: 1 epochs and 2 batches of epoch 2; "
        "give --epochs 2 or more"]  # fmt: skip
    assert (out / "last.pt").read_bytes() == kept and not (out / "summary.json").exists()
    lines = []
    summary = train(resolve_config(overrides={"out": str(out), "resume": True, "epochs": 2}), log=lines.append)
    assert any(line.startswith("shortening the run from 3 to 2 epochs") for line in lines)
    assert summary["epochs"] == 2 and summary["final_acc"] == evaluate_checkpoint(out, device="cpu")["top1"]


def test_resume_after_sigkill_completes_and_matches_uninterrupted_run(tmp_path):
    epochs, batches = 4, 4  # killed after its 2nd epoch: 2 more to run when the kill lands
    common = ["--epochs", str(epochs), "--max-train-batches", str(batches), "--batch-size", "32", "--no-progress",
              "--no-tensorboard", "--optimizer", "sgd", "--lr", "0.05"]  # fmt: skip
    ref = tmp_path / "ref"
    train(resolve_config(overrides={"epochs": epochs, "max_train_batches": batches, "batch_size": 32, "progress": False,
                                    "tensorboard": False, "optimizer": "sgd", "lr": 0.05, "out": str(ref)}))
    out = tmp_path / "killed"
    # the killed process computes this process's operations only on as many threads as this process: another count
    # splits the convolutions' and GEMMs' reductions otherwise, and 16 SGD steps amplify that rounding far past
    # any per-step bound (1 thread against 2: 174 of 214 tensors apart, by up to ~7000x the atol below, and the
    # final accuracy 0.32 against 0.23). Under ``-n 0`` on more than 2 cores a bare subprocess took every core.
    env = {**ENV, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    proc = subprocess.Popen([sys.executable, "-m", "lambdanet", "train", *common, "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.time() + 240
    metrics = out / "metrics.csv"
    while time.time() < deadline:  # kill it somewhere after two epochs are on disk
        if metrics.exists() and len(metrics.read_text().strip().splitlines()) >= 3:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = int(load_checkpoint(out / "last.pt")["epoch"])  # never truncated: always loadable
    assert 1 <= done < epochs, f"the run was not killed mid-way ({done} epochs done)"
    assert not list(out.glob("*.pt.tmp")) or load_checkpoint(out / "last.pt")
    summary = train(resolve_config(overrides={"out": str(out), "resume": True, "progress": False}))
    assert summary["epochs"] == epochs
    assert len(metrics.read_text().strip().splitlines()) == epochs + 1  # one row per epoch, none duplicated
    a, b = load_file(ref / "model.safetensors"), load_file(out / "model.safetensors")
    # the same float32 operations in the same order on the same thread count: measured equal bit for bit; the atol
    # (a few eps32 of the model's largest weight per step, 16 steps) is slack for a rounding or two, not a bound on
    # runs that differ from the first step (those drift apart by orders of magnitude more: see the env above)
    w_max = max(float(t.abs().max()) for t in a.values() if t.is_floating_point() and t.numel())
    atol = epochs * batches * 8 * torch.finfo(torch.float32).eps * w_max
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=atol, rtol=0, msg=key)
    assert summary["final_acc"] == pytest.approx(json.loads((ref / "summary.json").read_text())["final_acc"])


def test_corrupted_checkpoint_gets_a_clear_error(tmp_path):
    out = tmp_path / "run"
    train(resolve_config(overrides={**FAST, "epochs": 1, "out": str(out)}))
    data = (out / "last.pt").read_bytes()
    (out / "last.pt").write_bytes(data[: len(data) // 2])  # truncated by hand
    proc = run_cli("train", "--resume", "--out", str(out), "--no-progress")
    assert proc.returncode == 2
    assert "is corrupted or truncated" in proc.stderr and "Traceback" not in proc.stderr
    with pytest.raises(CheckpointError, match="corrupted or truncated"):
        evaluate_checkpoint(out / "last.pt")


def test_existing_run_is_not_overwritten_and_resume_needs_a_run(tmp_path):
    out = tmp_path / "run"
    train(resolve_config(overrides={**FAST, "epochs": 1, "out": str(out)}))
    with pytest.raises(ValueError, match="already holds a run.*--resume"):
        train(resolve_config(overrides={**FAST, "out": str(out)}))
    with pytest.raises(ValueError, match="nothing to resume"):
        train(resolve_config(overrides={**FAST, "out": str(tmp_path / "empty"), "resume": True}))


def test_a_finished_run_whose_checkpoint_was_deleted_is_not_overwritten(tmp_path):
    """Users delete ``last.pt`` (the largest file) once a run is done; a new run into that folder is refused in one
    line and leaves the finished run's weights and figures as they were."""
    out = tmp_path / "run"
    train(resolve_config(overrides={**FAST, "epochs": 1, "out": str(out)}))
    (out / "last.pt").unlink()
    files = lambda: {p.name: p.read_bytes() for p in out.iterdir() if p.name != ".lock"}  # noqa: E731 (the lock: a pid)
    kept = files()
    proc = run_cli("train", "--epochs", "1", "--max-train-batches", "2", "--no-progress", "--no-tensorboard",
                   "--out", str(out))  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().endswith(f"{out} already holds a finished run (summary.json, no last.pt to continue); "
                                        "choose another --out, or delete the run's files to train afresh there")
    assert files() == kept and "model.safetensors" in kept



def test_a_new_run_into_a_detect_runs_pretraining_is_refused(tmp_path, capsys):
    """A detect run stopped in its glyph pre-training holds config.yaml and pretrain.pt, no last.pt: a new ``train``
    run there wrote its own config.yaml over the detect run's, which could no longer be resumed."""
    import shutil

    out = tmp_path / "detect"
    shutil.copytree(Path(__file__).parent / "fixtures" / "runs_v1" / "detect_pretrain", out)
    kept = {p.name: p.read_bytes() for p in out.iterdir()}
    assert main(["train", "--epochs", "1", "--max-train-batches", "2", "--no-progress", "--no-tensorboard",
                 "--out", str(out)]) == 2  # fmt: skip
    assert capsys.readouterr().err.strip().endswith(f"{out} already holds a run (pretrain.pt); pass --resume to "
                                                    "continue it or choose another --out")  # fmt: skip
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.name != ".lock"} == kept
    assert main(["train", "--resume", "--out", str(out)]) == 2  # --resume names the command that continues it
    assert f"it is a detection run (lambdanet detect); continue it with lambdanet detect --resume --out {out}" in (
        capsys.readouterr().err)  # fmt: skip


class _Crash(Exception):
    """A process that dies (SIGKILL, a node lost) in the middle of a step, as far as its files are concerned."""


def _crash_after_step(step: int):
    from torch.optim.optimizer import register_optimizer_step_post_hook

    count = [0]

    def hook(optimizer, args, kwargs):
        count[0] += 1
        if count[0] == step:
            raise _Crash

    return register_optimizer_step_post_hook(hook)


def _logged_epochs(out: Path) -> tuple[list[float], list[float], list[tuple[int, float]]]:
    """(metrics.csv's epochs, its train losses, TensorBoard's (step, value) of train/loss as TensorBoard shows it)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = list(csv.DictReader((out / "metrics.csv").open()))
    events = EventAccumulator(str(out / "tb"))
    events.Reload()
    shown = [(e.step, e.value) for e in events.Scalars("train/loss")]
    return [float(r["epoch"]) for r in rows], [float(r["train_loss"]) for r in rows], shown


def test_epochs_an_attempt_logged_after_its_last_checkpoint_are_logged_once(tmp_path):
    """With --checkpoint-every 2 an attempt that dies in epoch 4 has logged epoch 3, which its last.pt (epoch 2) does
    not hold: the resumed run redoes it, and TensorBoard showed epoch 3 twice (metrics.csv once). An attempt that dies
    before its first checkpoint cannot be resumed; the new run in its folder appended to its metrics.csv (epoch 1
    twice) and TensorBoard. Each epoch is now logged once, with the values of the run that (re)did it."""
    base = dict(model="resnet26", model_kwargs={"base_width": 8}, epochs=4, max_train_batches=2, batch_size=16,
                progress=False, checkpoint_every=2, optimizer="sgd", lr=0.05)  # fmt: skip
    out, fresh = tmp_path / "resumed", tmp_path / "fresh"
    for folder, step, saved in ((out, 7, 2), (fresh, 3, None)):  # 2 steps per epoch: epoch 4's, epoch 2's first
        handle = _crash_after_step(step)
        try:
            with pytest.raises(_Crash):
                train(resolve_config(overrides={**base, "out": str(folder)}))
        finally:
            handle.remove()
        assert (load_checkpoint(folder / "last.pt")["epoch"] if saved else (folder / "last.pt").exists()) == (
            saved or False
        )
        assert _logged_epochs(folder)[0] == list(range(1, step // 2 + 1))  # epoch 3 / epoch 1 logged, not saved
    train(resolve_config(overrides={"out": str(out), "resume": True, "progress": False}))
    train(resolve_config(overrides={**base, "out": str(fresh)}))
    for folder in (out, fresh):
        epochs, losses, shown = _logged_epochs(folder)
        assert epochs == [1, 2, 3, 4]
        assert [step for step, _ in shown] == [1, 2, 3, 4]
        assert [value for _, value in shown] == pytest.approx(losses, rel=1e-6)  # TensorBoard keeps float32


class _NaNAfter(nn.Module):
    """A tiny classifier whose training forward returns NaN from its 5th call on."""

    def __init__(self, num_classes, in_chans):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(in_chans, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                 nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, num_classes))
        self.calls = 0

    def forward(self, x):
        if self.training:
            self.calls += 1
        out = self.net(x)
        return out * float("nan") if self.training and self.calls > 4 else out


@pytest.fixture
def nan_model():
    def test_nan_model(*, num_classes=10, in_chans=3, img_size=None):
        return _NaNAfter(num_classes, in_chans)

    register_model(test_nan_model, info=ModelInfo("test_nan_model", 16, "test"))
    yield "test_nan_model"
    unregister_model("test_nan_model")


def test_nan_loss_stops_with_a_clear_message_and_keeps_the_last_good_checkpoint(tmp_path, nan_model):
    out = tmp_path / "run"
    cfg = resolve_config(overrides={**FAST, "epochs": 3, "max_train_batches": 3, "model": nan_model,
                                    "out": str(out)})
    with pytest.raises(TrainingDivergedError, match=r"loss became nan at epoch 2, step 2.*last good checkpoint .*"
                                                    r"last.pt \(epoch 1\)"):
        train(cfg)
    state = load_checkpoint(out / "last.pt")
    assert state["epoch"] == 1 and all(torch.isfinite(v).all() for v in state["model"].values()
                                       if v.is_floating_point())
    # saved inside the epoch (--checkpoint-steps): the message says where last.pt stands, after epoch 2's first step
    cfg = resolve_config(overrides={**FAST, "epochs": 3, "max_train_batches": 3, "model": nan_model,
                                    "checkpoint_steps": 1, "out": str(tmp_path / "steps")})  # fmt: skip
    with pytest.raises(TrainingDivergedError, match=r"last good checkpoint .*last.pt \(epoch 2 after batch 1/3\)"):
        train(cfg)
    state = load_checkpoint(tmp_path / "steps" / "last.pt")
    assert (state["epoch"], state["step"], state["epoch_partial"]["batches"]) == (1, 4, 1)


def test_a_run_resumed_inside_an_epoch_that_diverges_names_where_its_checkpoint_stands(tmp_path, nan_model):
    """The divergence message names where last.pt stands; a run resumed from a step-level checkpoint (a step save,
    a signal) that diverged before its next save said ``(epoch 1)`` for the checkpoint of epoch 2's first step."""
    out = tmp_path / "run"
    run = {**FAST, "epochs": 3, "max_train_batches": 3, "model": nan_model, "out": str(out)}
    with pytest.raises(TrainingDivergedError, match=r"epoch 2, step 2"):  # the 5th step: last.pt after the 4th
        train(resolve_config(overrides={**run, "checkpoint_steps": 4, "checkpoint_every": 3}))
    state = load_checkpoint(out / "last.pt")
    assert (state["epoch"], state["epoch_partial"]["batches"]) == (1, 1)
    # resumed (a new model: NaN from its 5th step, epoch 3's 3rd) without saving again before it diverges
    with pytest.raises(TrainingDivergedError, match=r"epoch 3, step 3; .*last good checkpoint is .*last\.pt "
                                                    r"\(epoch 2 after batch 1/3\)"):  # fmt: skip
        train(resolve_config(overrides={"out": str(out), "resume": True, "checkpoint_steps": 0}))
    assert load_checkpoint(out / "last.pt")["step"] == state["step"]


class _InfGradAt(_NaNAfter):
    """A tiny classifier with finite losses whose gradient is infinite at its ``at``-th training step, so that step's
    update makes the weights NaN (AdamW: inf / inf) while its own loss was finite."""

    at = 6

    def __init__(self, num_classes, in_chans):
        super().__init__(num_classes, in_chans)
        self.spoiled = nn.Parameter(torch.zeros(()))

    def forward(self, x):
        if self.training:
            self.calls += 1
        spoiled = self.spoiled
        if self.training and self.calls == self.at:
            spoiled = spoiled.clone()
            spoiled.register_hook(lambda g: torch.full_like(g, float("inf")))
        return self.net(x) + 0 * spoiled  # 0 * NaN: the weights' NaN reaches every later output


@pytest.mark.parametrize(
    "at,steps,saved,where", [(6, 0, 3, r"last\.pt \(epoch 1\)"), (5, 1, 4, r"last\.pt \(epoch 2 after batch 1/3\)")]
)
def test_an_update_that_spoils_the_weights_at_a_saved_step_is_never_saved(tmp_path, monkeypatch, at, steps, saved,
                                                                          where):  # fmt: skip
    """The loss guard sees a spoiled update only at the next step's loss: the last step of a run (``at`` 6 of 6) would
    end the run with NaN weights saved and a NaN evaluation (exit 0), a step save after it (``at`` 5, saved every
    step) would write them as the "last good checkpoint". The weights are checked before every save."""
    monkeypatch.setattr(_InfGradAt, "at", at)
    def test_inf_grad_model(*, num_classes=10, in_chans=3, img_size=None):
        return _InfGradAt(num_classes, in_chans)

    register_model(test_inf_grad_model, info=ModelInfo("test_inf_grad_model", 16, "test"))
    try:
        out = tmp_path / "run"
        cfg = resolve_config(overrides={**FAST, "model": "test_inf_grad_model", "checkpoint_steps": steps,
                                        "out": str(out)})  # fmt: skip
        with pytest.raises(TrainingDivergedError, match=rf"weights became NaN or infinite by epoch 2, step {at - 3}"
                                                        rf".*last good checkpoint .*{where}"):  # fmt: skip
            train(cfg)
    finally:
        unregister_model("test_inf_grad_model")
    state = load_checkpoint(out / "last.pt")
    assert state["step"] == saved and all(torch.isfinite(v).all() for v in state["model"].values()
                                            if v.is_floating_point())  # fmt: skip


def test_a_last_step_that_diverges_is_an_error_not_a_result(tmp_path, capsys):
    """One step at lr 1e30 (no warm-up): its loss was finite, the finite weights after it overflow the evaluation.
    The run used to print a test top-1 from NaN logits, exit 0 and save the weights; now it stops as diverged."""
    out = tmp_path / "run"
    assert main(["train", "--epochs", "1", "--max-train-batches", "1", "--warmup-epochs", "0", "--lr", "1e30",
                 "--out", str(out), "--no-progress", "--no-tensorboard"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "the test loss became nan in the evaluation of epoch 1" in err and "no checkpoint had been written" in err
    assert err.count("\n") == 1 and not list(out.glob("*.pt")) and not list(out.glob("*.safetensors"))


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--model", "resnet51"], "unknown model 'resnet51'; did you mean resnet50"),
        (["--data", "svhn"], "unknown dataset 'svhn'; valid: cifar10, cifar100, digits"),
        (["--data", "imagefolder:/nonexistent/imagenet"], "needs the folders /nonexistent/imagenet/train"),
        (["--model", "resnet26", "--model-kwargs", "stage_layers=CCLL,spatial_layer=lambda,img_size=8",
          "--img-size", "16"], "cannot take 16x16 images from digits"),
        (["--batch-size", "4096"], "larger than the 1438 training images"),
        (["--val-split", "1.5"], "val_split must be in [0, 1)"),
        (["--val-split", "0.9999"], "larger than the 0 training images of digits left by --val-split 0.9999; lower "
                                    "--batch-size or change it"),  # fmt: skip
        (["--early-stop-patience", "2"], "needs a held-out validation set"),
    ],
)
def test_bad_train_arguments_fail_with_clear_messages(tmp_path, capsys, args, needle):
    assert main(["train", *args, "--out", str(tmp_path / "run"), "--no-progress"]) == 2
    assert needle in capsys.readouterr().err


def test_imagefolder_dataset_trains(tmp_path, image_folder):
    root = image_folder
    summary = train(resolve_config(overrides={**FAST, "data": f"imagefolder:{root}", "img_size": 16, "batch_size": 4,
                                              "out": str(tmp_path / "run")}))
    assert summary["epochs"] == 2 and 0.0 <= summary["final_acc"] <= 1.0


def test_a_run_resumes_with_its_dataset_at_another_place(tmp_path, image_folder):
    """A cluster job resumed on a node that mounts the data elsewhere: ``--resume --data imagefolder:/other/imgs``
    was refused ("--resume cannot change data") and the old path no longer existed, so the run could not go on.
    The same folder name elsewhere is the same dataset (as processes of one group already treat it); another
    name is still refused, saying so; ``--data-dir`` (where downloads live) may change too."""
    import shutil

    moved = tmp_path / "mnt2" / "imgs"
    shutil.copytree(image_folder, moved)
    base = {**FAST, "epochs": 1, "img_size": 16, "batch_size": 4, "out": str(tmp_path / "run")}
    train(resolve_config(overrides={**base, "data": f"imagefolder:{image_folder}"}))
    summary = train(resolve_config(overrides={"out": base["out"], "resume": True, "epochs": 2, "data_dir": "/tmp/x",
                                              "data": f"imagefolder:{moved}"}))  # fmt: skip
    assert summary["epochs"] == 2
    from lambdanet.engine.values import load_run_yaml

    assert load_run_yaml(tmp_path / "run" / "config.yaml")["data"] == f"imagefolder:{moved}"  # found there next
    other = tmp_path / "renamed"
    shutil.copytree(image_folder, other)
    with pytest.raises(ValueError, match="cannot change data: .* \\(a dataset moved elsewhere keeps its folder's"):
        resolve_config(overrides={"out": base["out"], "resume": True, "epochs": 3, "data": f"imagefolder:{other}"})\
            .check_resume()  # fmt: skip


def test_early_stopping_on_the_validation_split(tmp_path):
    first = []
    summary = train(resolve_config(overrides={**FAST, "epochs": 6, "val_split": 0.1, "early_stop_patience": 1,
                                              "lr": 1e-12, "schedule": "constant", "warmup_epochs": 0.0,
                                              "out": str(tmp_path / "run")}), log=first.append)  # fmt: skip
    stop_line = "early stopping: no validation improvement for 1 epochs"
    assert [s for s in first if "early stopping" in s] == [stop_line]  # said once, where it stopped
    assert first.index(stop_line) < next(i for i, s in enumerate(first) if s.startswith("epoch 2/6"))
    assert summary["stopped_early"] and summary["epochs"] == 2 and summary["best_selected_by"] == "validation top-1"
    said = []  # resumed with more epochs while its patience is still spent: it says it ends, not that it extends
    again = train(resolve_config(overrides={"out": str(tmp_path / "run"), "resume": True, "epochs": 8}),
                  log=said.append)  # fmt: skip
    assert again["epochs"] == 2 and again["stopped_early"] and (tmp_path / "run" / "model.safetensors").is_file()
    assert any("stopped early after epoch 2 and its rule to stop still holds: it ends there" in s for s in said), said
    assert [s for s in said if "early stopping" in s] == [stop_line]  # the loop says why, once
    assert not any("extending the run" in s for s in said), said


def test_sweep_writes_table_and_plot(tmp_path, capsys):
    out = tmp_path / "sweep"
    assert main(["sweep", "--lrs", "0.01", "0.001", "--models", "resnet26", "lambda_resnet26", "--epochs", "1",
                 "--max-train-batches", "2", "--batch-size", "32", "--no-progress", "--no-tensorboard",
                 "--out", str(out)]) == 0
    table = (out / "sweep.md").read_text()
    assert table.splitlines()[0] == "| learning rate | resnet26 | lambda_resnet26 |"
    assert len(table.strip().splitlines()) == 4 and (out / "sweep.png").exists()
    rows = json.loads((out / "sweep.json").read_text())["rows"]
    assert {(r["model"], r["lr"]) for r in rows} == {(m, lr) for m in ("resnet26", "lambda_resnet26")
                                                     for lr in (0.01, 0.001)}


def test_pseudo_labels_teacher_then_student(tmp_path, capsys):
    teacher = tmp_path / "teacher"
    train(resolve_config(overrides={**FAST, "epochs": 3, "max_train_batches": 8, "labeled_fraction": 0.3,
                                    "out": str(teacher)}))
    labels = tmp_path / "pl.pt"
    assert main(["pseudo-label", "--checkpoint", str(teacher / "last.pt"), "--out", str(labels)]) == 0
    pl = torch.load(labels, weights_only=True)
    assert len(pl["labels"]) == 1438 - round(1438 * 0.3) and 0.0 <= pl["agreement_with_true_labels"] <= 1.0
    student = train(resolve_config(overrides={**FAST, "labeled_fraction": 0.3, "pseudo_labels": str(labels),
                                              "out": str(tmp_path / "student")}))
    assert student["epochs"] == 2
    with pytest.raises(ValueError, match="were made for labeled_fraction=0.3"):
        train(resolve_config(overrides={**FAST, "labeled_fraction": 0.5, "pseudo_labels": str(labels),
                                        "out": str(tmp_path / "bad")}))
    # the teacher's own files are never an --out; the student resumes only on the pseudo-labels it trained on
    before = (teacher / "last.pt").read_bytes()
    capsys.readouterr()
    assert main(["pseudo-label", "--checkpoint", str(teacher), "--out", str(teacher / "last.pt")]) == 2
    assert "--out " in capsys.readouterr().err and (teacher / "last.pt").read_bytes() == before
    original = labels.read_bytes()
    assert main(["pseudo-label", "--checkpoint", str(teacher), "--out", str(labels), "--threshold", "0.5"]) == 0
    resume = {"out": str(tmp_path / "student"), "resume": True, "epochs": 3}
    with pytest.raises(ValueError, match=r"^pseudo_labels .*pl.pt are not the ones .*student.last.pt trained on"):
        train(resolve_config(overrides=resume))
    labels.write_bytes(original)
    assert train(resolve_config(overrides=resume))["epochs"] == 3


def test_pseudo_labels_of_an_image_folder_are_refused_before_any_work(tmp_path, image_folder):
    """A student trains on pseudo-labels of in-memory datasets only: a teacher of an image folder is refused before
    its labelling pass (a whole pass over a real folder), and a student on one names --pseudo-labels."""
    import dataclasses

    from lambdanet.engine.checkpoint import save_checkpoint
    from lambdanet.tasks.classification.config import TrainConfig
    from lambdanet.tasks.classification.pseudo import make_pseudo_labels

    data = f"imagefolder:{image_folder}"
    teacher = tmp_path / "teacher.pt"
    save_checkpoint({"config": dataclasses.asdict(TrainConfig(data=data, labeled_fraction=0.5)), "model": {}}, teacher)
    with pytest.raises(ValueError, match=r"^the teacher .* was trained on imagefolder:.*: pseudo-labels are made "
                                         r"for the in-memory datasets a student can train on \(digits, mnist5k"):
        make_pseudo_labels(teacher, tmp_path / "pl.pt")
    torch.save({"indices": torch.tensor([0]), "labels": torch.tensor([1]), "data": data, "labeled_fraction": 0.5,
                "seed": 0}, tmp_path / "pl.pt")  # fmt: skip
    cfg = resolve_config(overrides={**FAST, "data": data, "img_size": 16, "batch_size": 2, "labeled_fraction": 0.5,
                                    "pseudo_labels": str(tmp_path / "pl.pt"), "out": str(tmp_path / "s")})
    with pytest.raises(ValueError, match=r"^pseudo_labels \(--pseudo-labels\) are supported for in-memory datasets"):
        train(cfg)


# ----------------------------------------------------------------------------------------- distributed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _report_group(path):
    (Path(path) / os.environ["RANK"]).write_text(json.dumps(
        {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")} | {"threads": torch.get_num_threads()}))


class _BusyError(ValueError):
    """A user error of a ValueError subclass (as RunDirBusyError is)."""


def _user_error(message):
    raise _BusyError(message)


def _diverge(message):
    from lambdanet.tasks.classification.task import TrainingDivergedError

    raise TrainingDivergedError(message)


def test_launch_local_starts_a_process_group_and_relays_user_errors(tmp_path):
    from lambdanet.engine.distributed import DistContext, all_threads_on_main, launch_local, usable_cores
    from lambdanet.tasks.classification.task import TrainingDivergedError

    launch_local(_report_group, (str(tmp_path),), 2)
    seen = [json.loads((tmp_path / r).read_text()) for r in ("0", "1")]
    assert [(s["RANK"], s["LOCAL_RANK"], s["WORLD_SIZE"]) for s in seen] == [("0", "0", "2"), ("1", "1", "2")]
    assert all(s["threads"] == max(1, usable_cores() // 2) for s in seen)  # the cores shared out
    with pytest.raises(ValueError, match="^bad option x: expected y$"):  # one line, subclasses too
        launch_local(_user_error, ("bad option x: expected y",), 1)
    with pytest.raises(ValueError, match="nprocs must be a positive int"):
        launch_local(_user_error, ("",), 0)
    with pytest.raises(TrainingDivergedError, match="^loss nan at step 3: lower --lr$"):  # a type asked for
        launch_local(_diverge, ("loss nan at step 3: lower --lr",), 1, relay=(TrainingDivergedError,))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with all_threads_on_main(DistContext(rank=0, world=2)):
            assert torch.get_num_threads() == usable_cores()  # the others wait at a barrier meanwhile
        assert torch.get_num_threads() == 1
        with all_threads_on_main(DistContext(rank=1, world=2)):
            assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)


def _sync_bn_worker(rank, world, port, path):
    import torch.distributed as dist

    from lambdanet.engine.distributed import DistContext, all_gather_with_grad, cleanup, convert_sync_batchnorm

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = convert_sync_batchnorm(_smooth_net(), torch.device("cpu"))
    x, dy = _smooth_data()
    xs = x[rank::world].clone().requires_grad_()
    (model(xs) * dy[rank::world]).sum().backward()  # the global objective is the sum over both ranks
    for p in model.parameters():
        dist.all_reduce(p.grad)
    v, w = _gather_data(rank)
    v.requires_grad_()
    # a branch beside the gather: add's backward hands both the same gradient tensor, and exp's backward
    # (created earlier, so run later) reads it after the gather's backward has run
    q = torch.zeros(world, v.numel(), requires_grad=True)
    z = q.exp()
    gathered = all_gather_with_grad(v)
    ((gathered + z) * w).sum().backward()
    torch.save({"x": xs.grad, **{n: p.grad for n, p in model.named_parameters()},
                "running_mean": model[1].running_mean, "gathered": gathered.detach(), "v": v.grad,
                "q": q.grad},
               f"{path}.{rank}")
    cleanup(DistContext(rank, world), synchronize=True)


def _gather_data(rank):
    """Rank ``rank``'s vector and the weights of its share of the objective sum_r <all_gather(v)_r, w_r>."""
    g = torch.Generator().manual_seed(10 + rank)
    return torch.randn(3, generator=g), torch.randn(2, 3, generator=g)


def _smooth_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.BatchNorm2d(8), nn.SiLU(), nn.Conv2d(8, 8, 3, padding=1),
                         nn.BatchNorm2d(8), nn.SiLU())


def _smooth_data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 4, 5, 5, generator=g) * 3 + 2, torch.randn(8, 8, 5, 5, generator=g)


def test_allreduce_batchnorm_equals_whole_batch_batchnorm(tmp_path):
    """Two gloo processes with half the batch each compute what one process computes on the whole batch."""
    import torch.multiprocessing as mp

    path = str(tmp_path / "grads")
    mp.spawn(_sync_bn_worker, args=(2, _free_port(), path), nprocs=2)
    ref_model = _smooth_net().double()
    x, dy = _smooth_data()
    x = x.double().requires_grad_()
    (ref_model(x) * dy.double()).sum().backward()
    # Tolerances from the magnitudes: the workers compute in float32, and every gradient entry is a sum over the
    # n = 8 * 5 * 5 = 200 positions of the batch (BatchNorm's backward adds two more such sums) of terms no larger
    # than the largest gradient G of the model, so its rounding error is below ~ 3 n eps32 G. A gradient that is
    # zero in exact arithmetic (a conv bias before BatchNorm: the reference gives ~1e-14) is held to that absolute
    # bound too, not to a tolerance relative to its own size. Per-process BatchNorm statistics instead of the
    # whole batch's change the gradients by O(G).
    n_terms, eps32 = 3 * x.shape[0] * x.shape[2] * x.shape[3], torch.finfo(torch.float32).eps
    big = max(p.grad.abs().max() for p in ref_model.parameters())
    atol_params = n_terms * eps32 * float(big)
    atol_x = n_terms * eps32 * float(x.grad.abs().max())
    assert atol_params < 1e-2 * float(big)  # the bound is far below the O(G) error of a wrong reduction
    for rank in range(2):
        got = torch.load(f"{path}.{rank}", weights_only=True)
        torch.testing.assert_close(got["x"].double(), x.grad[rank::2], atol=atol_x, rtol=0)
        for name, p in ref_model.named_parameters():
            torch.testing.assert_close(got[name].double(), p.grad, atol=atol_params, rtol=0, msg=name)
        # running mean: momentum 0.1 times a mean of the first conv's outputs (each a sum of 4 * 9 + 1 terms)
        mean_scale = float(ref_model[0](x).detach().abs().max())
        torch.testing.assert_close(got["running_mean"].double(), ref_model[1].running_mean,
                                   atol=n_terms * eps32 * mean_scale, rtol=0)
        # all_gather_with_grad: every rank sees [v_0, v_1]; d/dv_rank of the summed objective is sum_r w_r[rank]
        (v0, w0), (v1, w1) = _gather_data(0), _gather_data(1)
        torch.testing.assert_close(got["gathered"], torch.stack([v0, v1]))
        torch.testing.assert_close(got["v"], (w0 + w1)[rank])
        torch.testing.assert_close(got["q"], (w0, w1)[rank])  # exp(0) = 1: the gather left the shared gradient alone


def _torchrun(nodes: int, args: list[str]) -> list[subprocess.Popen]:
    """``torchrun`` of ``lambdanet ARGS`` on two processes: one node with two, or two simulated nodes of one
    process each (two launchers meeting at a c10d rendezvous on 127.0.0.1, as on two machines)."""
    run = [sys.executable, "-m", "torch.distributed.run"]
    if nodes == 1:
        launchers = [[*run, "--standalone", "--nproc_per_node", "2"]]
    else:
        with socket.socket() as s:  # a free port for the rendezvous
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        launchers = [[*run, "--nnodes", "2", "--nproc_per_node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                      f"127.0.0.1:{port}", "--rdzv-id", "lambdanet-test"]] * 2
    return [subprocess.Popen([*launcher, "-m", "lambdanet", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=ENV) for launcher in launchers]


@pytest.mark.slow  # 30 s each; launch_local's tests (here and test_detect_train.py) cover the same process group
@pytest.mark.parametrize("nodes", [1, 2])
def test_torchrun_two_processes_match_one_process_with_the_same_global_batch(tmp_path, nodes):
    """The engine's loop runs unchanged from one process to two, on one node or on two (``--nnodes 2``): the
    same global batch gives the one-process run's losses and weight updates (to float32 noise)."""
    args = ["train", "--epochs", "2", "--max-train-batches", "4", "--batch-size", "32", "--sync-bn", "--optimizer",
            "sgd", "--lr", "0.05", "--no-progress", "--no-tensorboard"]
    for launcher in _torchrun(nodes, [*args, "--out", str(tmp_path / "ddp")]):
        _, err = launcher.communicate(timeout=300)
        assert launcher.returncode == 0, err[-2000:]
    single = run_cli(*args, "--out", str(tmp_path / "single"))
    assert single.returncode == 0, single.stderr[-2000:]
    s_ddp = json.loads((tmp_path / "ddp" / "summary.json").read_text())
    s_one = json.loads((tmp_path / "single" / "summary.json").read_text())
    assert s_ddp["processes"] == 2 and s_one["processes"] == 1
    rows_ddp = (tmp_path / "ddp" / "metrics.csv").read_text().splitlines()
    assert len(rows_ddp) == 3  # only rank 0 wrote
    hist = [[line.split(",") for line in (tmp_path / d / "metrics.csv").read_text().splitlines()[1:]]
            for d in ("ddp", "single")]
    header = (tmp_path / "single" / "metrics.csv").read_text().splitlines()[0].split(",")
    for col in ("train_loss", "test_loss"):
        i = header.index(col)
        for a, b in zip(*hist):
            assert float(a[i]) == pytest.approx(float(b[i]), abs=2e-3), col
    # compare the weight updates (the initialisation is reproduced from the seed): float32 and ReLU-kink noise
    # gives ~1e-3; per-process BatchNorm (no --sync-bn) gives ~4e-2, wrong sharding or averaging far more
    torch.manual_seed(0)
    init = create_model("lambda_resnet26", num_classes=10, in_chans=1, **s_one["model_kwargs"]).state_dict()
    a, b = load_file(tmp_path / "ddp" / "model.safetensors"), load_file(tmp_path / "single" / "model.safetensors")
    keys = [k for k in a if "running" not in k and "num_batches" not in k]
    da = torch.cat([(a[k] - init[k]).flatten() for k in keys])
    db = torch.cat([(b[k] - init[k]).flatten() for k in keys])
    assert db.norm() > 0 and (da - db).norm() / db.norm() < 1e-2


def test_unregister_model_forgets_its_declared_arguments():
    def test_tmp_model(*, num_classes=10, in_chans=3, width=4):
        return nn.Linear(in_chans, num_classes)

    from lambdanet.models import model_args

    register_model(test_tmp_model)
    assert model_args("test_tmp_model") == {"width": 4}
    unregister_model("test_tmp_model")
    with pytest.raises(ValueError, match="unknown model 'test_tmp_model'"):
        model_args("test_tmp_model")

    def test_tmp_model(*, num_classes=10, in_chans=3, **kwargs):  # noqa: F811  same name, undeclared keywords
        return nn.Linear(in_chans, num_classes)

    register_model(test_tmp_model)
    assert model_args("test_tmp_model") == {}  # not the first model's {"width": 4}
    unregister_model("test_tmp_model")


# ------------------------------------------------------------------------------- run directories, size options


def test_eval_takes_a_run_directory_as_its_last_pt(tiny_digits_run, tmp_path, capsys):
    """``eval --checkpoint RUN_DIR`` evaluates the run's last.pt (the same numbers as naming the file); a folder
    without one is a one-line error naming what it lacks."""
    results = []
    for path in (tiny_digits_run / "last.pt", tiny_digits_run):
        assert main(["eval", "--checkpoint", str(path), "--json"]) == 0
        results.append(json.loads(capsys.readouterr().out))
    assert results[1] == results[0] and results[1]["checkpoint"] == str(tiny_digits_run / "last.pt")
    assert results[1]["samples"] == 359 and results[1]["top1"] == pytest.approx(
        json.loads((tiny_digits_run / "summary.json").read_text())["final_acc"])
    assert main(["eval", "--checkpoint", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{tmp_path} is a directory but holds no training checkpoint (last.pt)" in err
    assert len(err.splitlines()) == 1


def test_randaugment_reaches_the_papers_largest_magnitude():
    """HaloNet H7's recipe takes RandAugment magnitude 31, one past torchvision's default 31 bins (0-30), where
    its RandAugment fails with an IndexError: the bins are widened to reach it."""
    from lambdanet.tasks.classification.data import rand_augment
    from lambdanet.models import model_info

    assert model_info("halonet_h7").recipe["randaugment_magnitude"] == 31
    image = torch.randint(0, 256, (3, 16, 16), dtype=torch.uint8)
    torch.manual_seed(0)
    for magnitude in (0, 15, 30, 31):
        out = rand_augment(2, magnitude)(image)
        assert out.shape == image.shape and out.dtype == torch.uint8
    assert rand_augment(2, 31).num_magnitude_bins == 32 and rand_augment(2, 10).num_magnitude_bins == 31


@pytest.mark.parametrize("args,needle", [
    (["--img-size", "0"], "img_size must be a positive int (the training resolution in pixels"),
    (["--img-size", "-3"], "img_size must be a positive int"),
    (["--max-train-batches", "0"], "max_train_batches must be a positive int (batches per epoch) or null, got 0"),
    (["--val-split", "0.1", "--early-stop-patience", "0"], "early_stop_patience must be a positive int (epochs)"),
    (["--compact-width", "0"], "compact_width must be a positive int (channels) or null, got 0"),
    (["--lr-batch-scale", "0"], "lr_batch_scale must be a positive int (a batch size) or null, got 0"),
    (["--workers", "-1"], "workers must be a non-negative int, got -1"),
    (["--randaugment-layers", "-1"], "randaugment_layers must be a non-negative int, got -1"),
    (["--randaugment-magnitude", "-1"], "randaugment_magnitude must be a non-negative int, got -1"),
    (["--lr-decay-epochs", "0"], "lr_decay_epochs must be positive, got 0"),
    (["--warmup-epochs", "-1"], "warmup_epochs must be >= 0, got -1"),
    (["--model", "lambda_resnet26t", "--img-size", "8"],
     "cannot take 8x8 images from digits"),
    (["--model-kwargs", "in_chans=1"], "model_kwargs must not set in_chans or num_classes: the model takes the "
                                       "data's channels"),
])
def test_size_options_out_of_range_fail_in_one_line(tmp_path, capsys, args, needle):
    """Sizes and counts out of range stop before any data or model work with one line naming the option and
    what it must be; an image size below what a model's downsampling needs is caught by the dry run."""
    assert main(["train", *args, "--out", str(tmp_path / "run"), "--no-progress", "--no-tensorboard"]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err
    if "lambda_resnet26t" in args:
        assert err.endswith("it downsamples by 32: use --img-size 32 or more")


def test_run_state_records_the_best_epoch_and_counts_the_epochs_since():
    """RunState.record keeps the highest score's reported metrics and counts the epochs without improvement
    (early stopping); a run saved before any epoch by an earlier version (a placeholder best of epoch 0,
    score -1) has no best yet, so even a score below -1 (a language model's negated bits per byte) is one."""
    from lambdanet.engine.state import RunState

    model = torch.nn.Linear(2, 2)
    state = RunState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for epoch, score in enumerate([0.5, 0.7, 0.6, 0.7, 0.8], 1):
        state.epoch = epoch
        state.record(score, test_top1=score / 2)
        expected_best = max([0.5, 0.7, 0.6, 0.7, 0.8][:epoch])
        assert state.best["score"] == expected_best and state.best["test_top1"] == expected_best / 2
    assert state.best["epoch"] == 5 and state.bad_epochs == 0
    state.epoch = 6
    state.record(0.1)
    assert state.best["epoch"] == 5 and state.bad_epochs == 1
    old = RunState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    old.best = {"score": -1.0, "test_top1": 0.0, "epoch": 0}  # what 0.1's checkpoints hold before epoch 1
    old.epoch = 1
    old.record(-3.2, val_bits_per_byte=3.2)
    assert old.best == {"score": -3.2, "val_bits_per_byte": 3.2, "epoch": 1} and old.bad_epochs == 0


# ------------------------------------------------------------------------------------------ best-epoch weights


def scripted_evaluation(monkeypatch, top1: dict, snapshots: dict) -> None:
    """Every evaluation of epoch e reports top-1 ``top1[e]`` (so the best epoch is known in advance), and
    ``snapshots[e]`` keeps the raw and EMA weights at the end of epoch e, as the run has them."""
    from lambdanet.tasks.classification import task as trainer

    current, original = {}, trainer.ClassificationTask.epoch_row

    def epoch_row(self, state, model, result):
        ema = state.ema.module.state_dict() if state.ema is not None else {}
        snapshots[state.epoch] = ({k: v.clone() for k, v in state.model.state_dict().items()},
                                  {k: v.clone() for k, v in ema.items()})
        current["epoch"] = state.epoch
        return original(self, state, model, result)

    monkeypatch.setattr(trainer.ClassificationTask, "epoch_row", epoch_row)
    monkeypatch.setattr(trainer, "evaluate",
                        lambda *a, **kw: {"loss": 1.0, "top1": top1[current["epoch"]], "top5": 1.0})


def same_weights(path: Path, weights: dict) -> bool:
    stored = load_file(path)
    return stored.keys() == weights.keys() and all(torch.equal(stored[k], weights[k]) for k in stored)


def test_best_epoch_weights_are_that_epochs_and_resumed_runs_keep_them(tmp_path, monkeypatch, capsys):
    """model_best(_ema).safetensors hold the weights at the end of summary.json's best epoch (the maximum of
    metrics.csv's selection column), also after a resumed run finds a new best, after a crash left best weights
    of an epoch the resumed run trains again, and never weights of another epoch (then none)."""
    from safetensors import safe_open

    from lambdanet import load_model

    out, snaps = tmp_path / "run", {}
    scripted_evaluation(monkeypatch, {1: 0.3, 2: 0.9, 3: 0.5, 4: 0.95, 5: 0.2, 6: 0.1}, snaps)
    summary = train(resolve_config(overrides={**FAST, "epochs": 3, "max_train_batches": 2, "batch_size": 16,
                                              "ema_decay": 0.9, "mixup": 0.2, "cutmix": 1.0, "out": str(out)}))
    rows = list(csv.DictReader(open(out / "metrics.csv")))
    best_row = max(rows, key=lambda r: float(r["test_top1_ema"]))
    assert summary["best_epoch"] == int(best_row["epoch"]) == 2 and math.isfinite(float(rows[0]["train_loss"]))
    assert same_weights(out / "model_best.safetensors", snaps[2][0])
    assert same_weights(out / "model_best_ema.safetensors", snaps[2][1])
    assert same_weights(out / "model.safetensors", snaps[3][0]) and not same_weights(out / "model.safetensors",
                                                                                      snaps[2][0])
    with safe_open(str(out / "model_best.safetensors"), "pt") as f:
        assert json.loads(f.metadata()["epoch"]) == 2
    assert load_model(out / "model_best.safetensors").pretrained_cfg["architecture"] == "lambda_resnet26"

    def resume(epochs):
        return train(resolve_config(overrides={"out": str(out), "resume": True, "epochs": epochs, "progress": False}))

    assert resume(4)["best_epoch"] == 4  # a new best after resuming
    assert same_weights(out / "model_best.safetensors", snaps[4][0])
    # a crash after epoch 5 wrote its (here: wrong) best weights and before last.pt: the resumed run restores epoch
    # 4's, which last.pt holds, and epoch 5 is no new best
    save_file({k: torch.zeros_like(v) for k, v in snaps[4][0].items()}, str(out / "model_best.safetensors"),
              {"epoch": "5"})
    assert resume(5)["best_epoch"] == 4
    assert same_weights(out / "model_best.safetensors", snaps[4][0])
    assert same_weights(out / "model_best_ema.safetensors", snaps[4][1])
    # the same with the best epoch's weights no longer at hand (last.pt is of epoch 5): removed, with a note
    save_file({k: torch.zeros_like(v) for k, v in snaps[4][0].items()}, str(out / "model_best.safetensors"),
              {"epoch": "6"})
    capsys.readouterr()
    assert resume(6)["best_epoch"] == 4
    assert not (out / "model_best.safetensors").exists() and not (out / "model_best_ema.safetensors").exists()
    assert "note: no model_best.safetensors for the best epoch 4" in capsys.readouterr().out


@pytest.mark.parametrize("mode, expected", [("default", None), ("reduce-overhead", "reduce-overhead"),
                                            ("max-autotune", "max-autotune")])
def test_compile_mode_reaches_torch_compile(mode, expected, monkeypatch, tmp_path):
    """``--compile --compile-mode reduce-overhead`` (CUDA graphs) compiles the trained model in that mode, for every
    task (the engine's ``Task.wrap``); without ``--compile`` nothing is compiled; a bad mode is a one-line error."""
    from lambdanet.engine.distributed import DistContext
    from lambdanet.tasks.classification.config import TrainConfig
    from lambdanet.tasks.classification.task import ClassificationTask
    from lambdanet.tasks.lm.config import LMConfig
    from lambdanet.tasks.lm.task import LanguageModelTask

    seen = []
    monkeypatch.setattr(torch, "compile", lambda model, **kw: seen.append(kw) or model)
    model = nn.Linear(2, 2)
    for task_cls, cfg_cls in ((ClassificationTask, TrainConfig), (LanguageModelTask, LMConfig)):
        for compile_ in (False, True):
            cfg = cfg_cls(compile=compile_, compile_mode=mode, out=str(tmp_path))
            assert task_cls(cfg, DistContext(), lambda _: None).wrap(model) is model
    assert seen == [{"mode": expected}] * 2
    with pytest.raises(ValueError, match=r"^compile_mode must be one of \['default', 'reduce-overhead', 'max-autot"):
        TrainConfig(compile_mode="graphs").validate()
