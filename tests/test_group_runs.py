"""Runs of several processes and sweeps of several runs: a process group given different options refuses in one
line instead of waiting forever, a finished run resumed by a group ends on every process, a launcher stopped
before its workers could save exits with the signal's status; a sweep resolves every run first, keeps going past a
diverged rate, and names each rate's folder exactly."""

import contextlib
import io
import math
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from lambdanet.cli import main
from lambdanet.engine.config import ConfigSource
from lambdanet.engine.distributed import DistContext, launch_local
from lambdanet.engine.loop import TrainingDivergedError
from lambdanet.engine.preempt import Preempted, exit_status
from lambdanet.tasks.classification import sweep
from lambdanet.tasks.classification.config import TrainConfig

TINY = ["train", "--data", "digits", "--model", "resnet26", "--model-kwargs", "base_width=8", "--epochs", "1",
        "--batch-size", "16", "--max-train-batches", "2", "--no-progress", "--no-tensorboard", "--device", "cpu"]


def _member(args: list[str], status: int, report: str, vary: bool = False) -> None:
    """One process of a group: ``lambdanet ARGS`` (with ``--seed <rank>`` where ``vary``), its stderr kept in
    ``<report>/<rank>.err``; its exit status must be ``status``."""
    rank = int(os.environ["RANK"])
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        got = main([*args, *(["--seed", str(rank)] if vary else [])])
    (Path(report) / f"{rank}.err").write_text(err.getvalue())
    assert got == status, (got, err.getvalue())


def test_a_group_given_different_options_refuses_in_one_line(tmp_path):
    """Options that differ between the processes (a launcher script varying them by rank) would train mismatched
    shards, or hang in a collective only some reach: every process stops with one line naming them, before any
    file of the run is written."""
    launch_local(_member, ([*TINY, "--out", str(tmp_path / "run")], 2, str(tmp_path), True), 2)
    for rank in (0, 1):
        err = (tmp_path / f"{rank}.err").read_text().strip()
        assert err == ("lambdanet train: error: the 2 processes were given different options (seed: rank 0 0, rank 1 "
                       "1); give every process the same command")  # fmt: skip
    assert not (tmp_path / "run" / "config.yaml").exists()


def test_a_group_resuming_a_finished_run_ends_on_every_process(tmp_path):
    """A scheduler requeues a finished job: every process of the group ends it (the other processes have no history
    to report: they formatted the main process's summary, missing there, and failed)."""
    out = str(tmp_path / "run")
    assert main([*TINY, "--out", out]) == 0
    launch_local(_member, ([*TINY, "--out", out, "--resume"], 0, str(tmp_path)), 2)


def test_the_batch_line_says_the_global_batch_and_its_share():
    assert DistContext(world=1).shared(32) == "32"
    assert DistContext(rank=1, world=2).shared(32) == "32 (16 per process x 2)"


def _sleep() -> None:
    time.sleep(60)


def test_a_launcher_stopped_before_its_workers_could_save_exits_with_the_signals_status():
    before, done = signal.getsignal(signal.SIGTERM), threading.Event()

    def stop_once_forwarded():  # SIGTERM only once the launcher forwards it (not a fixed delay: a loaded machine may
        deadline = time.monotonic() + 120  # start it later, and the signal would then end this test process)
        while not done.is_set() and time.monotonic() < deadline:
            if signal.getsignal(signal.SIGTERM) is not before:
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.01)

    timer = threading.Thread(target=stop_once_forwarded, daemon=True)
    timer.start()
    try:
        with pytest.raises(Preempted, match="^stopped by SIGTERM before the worker processes could save") as caught:
            launch_local(_sleep, (), 1, stopped=Preempted)
    finally:
        done.set()
    assert exit_status(caught.value) == 128 + signal.SIGTERM


def test_an_empty_share_of_the_test_split_skips_the_dry_run():
    from lambdanet.tasks.classification.task import _dry_run

    assert _dry_run(None, [], None, None) is None  # a process with no test image: nothing to try


def test_a_mistyped_option_of_lm_train_shows_lm_trains_usage(capsys):
    with pytest.raises(SystemExit) as caught:
        main(["lm", "train", "--procs", "2"])
    err = capsys.readouterr().err
    assert caught.value.code == 2 and err.startswith("usage: lambdanet lm train ")
    assert err.strip().endswith("lambdanet lm train: error: unrecognized arguments: --procs 2 (see 'lambdanet lm "
                                "train --help')")  # fmt: skip


# ------------------------------------------------------------------------------------------------------- sweeps


def _source(tmp_path, **overrides) -> ConfigSource:
    return ConfigSource(TrainConfig, "quick", {}, {"data": "digits", "out": str(tmp_path / "sweep"), **overrides})


def _fake_train(calls: list, diverge_above: float = math.inf):
    def train(cfg, log=print):
        calls.append((cfg.model, cfg.lr))
        if cfg.lr > diverge_above:
            raise TrainingDivergedError(f"the training loss became nan at epoch 1, step 3 (lr {cfg.lr:g})")
        return {"final_acc": 0.5, "best_acc": 0.6, "train_time_s": 1.0}

    return train


def test_a_sweep_goes_past_a_diverged_rate_and_does_not_train_it_again(tmp_path, monkeypatch):
    calls: list = []
    monkeypatch.setattr(sweep, "train", _fake_train(calls, diverge_above=1.0))
    monkeypatch.setattr(sweep, "plot_sweep", lambda rows, path: None)
    rows = sweep.lr_sweep(_source(tmp_path), [1e4, 0.002], log=lambda s: None)
    assert calls == [("lambda_resnet26", 1e4), ("lambda_resnet26", 0.002)]
    assert math.isnan(rows[0]["final_acc"]) and rows[1]["final_acc"] == 0.5
    import json

    saved = json.loads((tmp_path / "sweep" / "sweep.json").read_text())  # valid JSON: null, not NaN
    assert saved["rows"][0]["final_acc"] is None and saved["rows"][1]["final_acc"] == 0.5
    run = tmp_path / "sweep" / "lambda_resnet26" / "lr_10000"
    assert "loss became nan" in (run / "diverged.txt").read_text()
    assert "| 10000 | diverged |" in (tmp_path / "sweep" / "sweep.md").read_text()
    again: list = []
    monkeypatch.setattr(sweep, "train", _fake_train(again, diverge_above=1.0))
    assert math.isnan(sweep.lr_sweep(_source(tmp_path), [1e4], log=lambda s: None)[0]["final_acc"])
    assert again == []


def test_a_sweep_checks_every_run_before_training_any(tmp_path, monkeypatch):
    calls: list = []
    monkeypatch.setattr(sweep, "train", _fake_train(calls))
    with pytest.raises(ValueError, match="nosuchmodel"):
        sweep.lr_sweep(_source(tmp_path), [0.002], ["resnet26", "nosuchmodel"], log=lambda s: None)
    for bad in (math.nan, math.inf, -0.1, 0.0, 10**400):
        with pytest.raises(ValueError, match=r"^lrs must be positive finite learning rates, got \["):
            sweep.lr_sweep(_source(tmp_path), [0.002, bad], log=lambda s: None)
    assert calls == []


def test_sweep_rates_get_folders_of_their_own_and_duplicates_train_once(tmp_path, monkeypatch):
    assert sweep.run_name(0.001) == "lr_0.001" and sweep.run_name(1e-4) == "lr_0.0001"  # as every earlier version
    assert sweep.run_name(0.0010000001) == "lr_0.0010000001"  # %g would give lr_0.001: another rate's folder
    calls: list = []
    monkeypatch.setattr(sweep, "train", _fake_train(calls))
    monkeypatch.setattr(sweep, "plot_sweep", lambda rows, path: None)
    rows = sweep.lr_sweep(_source(tmp_path, resume=True), [1e-3, 0.001, 0.0010000001], log=lambda s: None)
    assert calls == [("lambda_resnet26", 0.001), ("lambda_resnet26", 0.0010000001)] and len(rows) == 2


def test_a_sweep_of_an_earlier_version_resumes_in_its_folders_and_numpy_rates_work(tmp_path, monkeypatch):
    """0.1 named every rate's folder ``lr_<:g>``: a rate ``%g`` rounds (3.1622777e-4 -> lr_0.000316228) keeps that
    folder where it holds a run at exactly that rate; a numpy rate (``np.logspace``) is a float like any other."""
    import numpy as np
    import yaml

    rate = 0.00031622777
    earlier = tmp_path / "sweep" / "lambda_resnet26" / "lr_0.000316228"
    earlier.mkdir(parents=True)
    (earlier / "config.yaml").write_text(yaml.safe_dump({"lr": rate}))
    assert sweep.run_name(rate, tmp_path / "sweep", "lambda_resnet26") == "lr_0.000316228"
    assert sweep.run_name(rate, tmp_path / "sweep", "resnet26") == "lr_0.00031622777"  # no earlier run there
    # the rate that folder's name spells, asked beside it: a folder of its own, never the other rate's
    assert sweep.run_name(0.000316228, tmp_path / "sweep", "lambda_resnet26") == f"lr_{0.000316228.hex()}"
    assert sweep.run_name(np.float64(0.001)) == "lr_0.001" and sweep.lr_text(np.float64(rate)) == "0.00031622777"
    calls: list = []
    monkeypatch.setattr(sweep, "train", _fake_train(calls))
    monkeypatch.setattr(sweep, "plot_sweep", lambda rows, path: None)
    monkeypatch.setattr(sweep, "config_differences", lambda *a, **k: {})  # the bare config.yaml above
    rows = sweep.lr_sweep(_source(tmp_path), list(np.array([rate, 1e-3])), log=lambda s: None)
    assert [r["lr"] for r in rows] == [rate, 0.001] and all(type(r["lr"]) is float for r in rows)
    assert "| 0.00031622777 |" in (tmp_path / "sweep" / "sweep.md").read_text()
    folders: list = []
    monkeypatch.setattr(sweep, "train", lambda cfg, log=print: folders.append(cfg.out) or
                        {"final_acc": 0.5, "best_acc": 0.6, "train_time_s": 1.0})  # fmt: skip
    sweep.lr_sweep(_source(tmp_path), [rate, 0.000316228], log=lambda s: None)  # both: a folder each
    assert len(set(folders)) == 2 and folders[0].endswith("lr_0.000316228")


def test_a_stopped_sweep_says_to_rerun_the_sweep(tmp_path, monkeypatch):
    def stopped(cfg, log=print):
        raise Preempted(f"stopped by SIGTERM at epoch 1, step 3: saved {cfg.out}/last.pt; continue with --resume "
                        f"--out {cfg.out}")  # fmt: skip

    monkeypatch.setattr(sweep, "train", stopped)
    with pytest.raises(Preempted) as caught:
        sweep.lr_sweep(_source(tmp_path), [0.002], log=lambda s: None)
    assert str(caught.value).endswith("/last.pt; continue with the same lambdanet sweep command")
    assert exit_status(caught.value) == 128 + signal.SIGTERM


def test_a_sweep_under_torchrun_is_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="^lambdanet sweep trains its runs one after another in one process"):
        sweep.lr_sweep(_source(tmp_path), [0.002], log=lambda s: None)


def test_a_run_that_fails_before_writing_anything_leaves_no_folder(tmp_path, capsys):
    """An error found after the run directory is locked (a class folder without images, found as the data is
    read) left a folder holding only ``.lock``; a folder that existed before stays."""
    for split in ("train", "val"):
        (tmp_path / "images" / split / "cats").mkdir(parents=True)
    out, data = tmp_path / "new" / "run", f"imagefolder:{tmp_path / 'images'}"
    assert main([*TINY, "--data", data, "--out", str(out)]) == 2
    assert "Found no valid file for the classes cats" in capsys.readouterr().err and not out.exists()
    out.mkdir(parents=True)
    assert main([*TINY, "--data", data, "--out", str(out)]) == 2
    assert out.is_dir()  # the user's folder: kept


@pytest.mark.parametrize("family", ["lambda", "plain_lambda", "linear", "hybrid", "transformer"])
def test_every_language_model_parameter_gets_a_gradient_of_its_own_layout(family):
    """DistributedDataParallel copies each gradient into a bucket laid out as its parameter, and warns on every
    step of every process where the strides differ (the position embeddings' gradient had a stride on their size-1
    axis, from a permute in the causal op)."""
    import torch

    from lambdanet.models import create_model

    model = create_model(f"{family}_lm_nano")
    model(torch.randint(0, 256, (2, 40))).float().sum().backward()
    odd = {n: (p.stride(), p.grad.stride()) for n, p in model.named_parameters()
           if p.grad is not None and p.grad.stride() != p.stride()}  # fmt: skip
    assert not odd


def test_options_of_each_process_own_may_differ(monkeypatch):
    """Multi-node groups: each node's own copy of the data (another folder, same name), its own loader workers and
    output settings are no mismatch; another dataset is."""
    import dataclasses

    from lambdanet.engine import task as engine_task

    ctx = DistContext(rank=1, world=2)

    def sent(cfg):  # what a process contributes to the comparison
        seen: list = []
        monkeypatch.setattr(engine_task, "all_gather_objects", lambda obj, ctx: (seen.append(obj), [obj, obj])[1])
        engine_task.check_same_config(cfg, ctx)
        return seen[0]

    def check(rank0, mine):
        payload = sent(rank0)
        monkeypatch.setattr(engine_task, "all_gather_objects", lambda obj, ctx: [payload, obj])
        engine_task.check_same_config(mine, ctx)

    base = dataclasses.replace(TrainConfig(), data="imagefolder:/node0/pets", out="/runs/a", workers=2)
    check(base, dataclasses.replace(base, data="imagefolder:/scratch/node1/pets", out="/b", workers=7, progress=False))
    with pytest.raises(ValueError, match=r"^the 2 processes were given different options \(data: rank 0 "):
        check(base, dataclasses.replace(base, data="imagefolder:/node0/flowers"))
    with pytest.raises(ValueError, match=r"\(lr: rank 0 0.1, rank 1 0.2\)"):
        check(dataclasses.replace(base, lr=0.1), dataclasses.replace(base, lr=0.2))



def test_a_groups_ema_figures_are_those_of_the_ema_weights_it_saves(tmp_path):
    """Each process's EMA averaged its own BatchNorm statistics (its own batches'), and the EMA's evaluation, sharded
    over the processes, measured a mix of two models: the logged EMA top-1 (0.114 here) was not that of the EMA
    weights the run saved (0.097 by ``eval``). The main process's EMA buffers go to every process first."""
    from lambdanet.tasks.classification.task import evaluate_checkpoint

    out = tmp_path / "run"
    args = [*TINY, "--max-train-batches", "6", "--ema-decay", "0.9", "--optimizer", "sgd", "--lr", "0.05",
            "--drop-path-rate", "0.1", "--out", str(out)]  # fmt: skip
    launch_local(_member, (args, 0, str(tmp_path)), 2)
    logged = (out / "metrics.csv").read_text().splitlines()
    row = dict(zip(logged[0].split(","), logged[-1].split(",")))
    assert float(row["test_top1_ema"]) == evaluate_checkpoint(out, device="cpu")["top1"]  # counts: exact


# 2 processes, 2 epochs of 3 batches, stochastic depth (draws on every step) and an EMA
GROUP_RUN = [*TINY, "--epochs", "2", "--max-train-batches", "3", "--drop-path-rate", "0.1", "--ema-decay", "0.9",
             "--optimizer", "sgd", "--lr", "0.05"]  # (the last of a flag given twice counts)


def _member_failing_evaluation(args: list[str], report: str, failing: int) -> None:
    """One process of a group whose rank ``failing`` cannot evaluate epoch 1 (an unreadable image): it stops with
    one line (status 2); its peer's collective then fails as gloo reports it (the connection closed)."""
    from lambdanet.tasks.classification import task as classification_task

    rank, real = int(os.environ["RANK"]), classification_task.evaluate

    def evaluate(*a, **kw):
        if rank == failing:
            raise ValueError("image 3.png is not a readable image")
        return real(*a, **kw)

    classification_task.evaluate = evaluate
    try:
        got = str(main(args))
    except RuntimeError as err:  # the peer's failure, seen in a collective
        got = f"peer: {err}"
    (Path(report) / f"{rank}.status").write_text(got)


@pytest.fixture(scope="module")
def whole_group_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("group") / "whole"
    launch_local(_member, ([*GROUP_RUN, "--out", str(out)], 0, str(out.parent)), 2)
    return out


@pytest.mark.slow  # three two-process runs each, about 40 s on 2 cores
@pytest.mark.parametrize("failing", [0, 1])
def test_a_group_whose_evaluation_fails_keeps_the_epochs_training_and_resumes_exactly(tmp_path, failing,
                                                                                      whole_group_run):
    """An evaluation that fails on one process of a group (its own error on the main process, or the peer's as the
    main process's collective reports it) kept nothing of the epoch's training: the main process now saves it as a
    single process does (every process's generators gathered before the evaluation), and ``--resume`` by the group
    evaluates it again and ends with the weights and figures of the group run that never failed."""
    import torch
    from safetensors.torch import load_file

    from lambdanet.engine.checkpoint import load_checkpoint

    out = tmp_path / "failed"
    launch_local(_member_failing_evaluation, ([*GROUP_RUN, "--out", str(out)], str(tmp_path), failing), 2)
    assert (tmp_path / f"{failing}.status").read_text() == "2"
    assert (tmp_path / f"{1 - failing}.status").read_text().startswith("peer: ")
    saved = load_checkpoint(out / "last.pt")
    assert saved["epoch"] == 0 and saved["epoch_partial"]["batches"] == 3 and len(saved["rng_ranks"]) == 2
    launch_local(_member, ([*GROUP_RUN, "--out", str(out), "--resume"], 0, str(tmp_path)), 2)
    for name in ("model.safetensors", "model_ema.safetensors"):
        a, b = load_file(whole_group_run / name), load_file(out / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    rows = [(d / "metrics.csv").read_text().splitlines() for d in (out, whole_group_run)]
    header = rows[1][0].split(",")
    for col in ("epoch", "train_loss", "test_top1", "test_top1_ema"):  # one row per epoch, the same figures
        i = header.index(col)
        assert [r.split(",")[i] for r in rows[0][1:]] == [r.split(",")[i] for r in rows[1][1:]], col
