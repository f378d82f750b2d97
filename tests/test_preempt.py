"""Preemption: SIGTERM / SIGINT mid-epoch saves a step-level checkpoint, exits non-zero on one line, and
``--resume`` ends with the weights of a run that was never stopped."""

import contextlib
import json
import os
import random
import select
import signal

import pytest
import torch
from safetensors.torch import load_file
from torch.optim.optimizer import register_optimizer_step_post_hook

from lambdanet.cli import main
from lambdanet.engine.checkpoint import load_checkpoint
from lambdanet.engine.preempt import Preempted, StopSignals, exit_status

# 2 epochs of 5 batches: a signal after global step 7 lands in epoch 2, after its batch 2
TRAIN = ["train", "--model", "resnet26", "--epochs", "2", "--max-train-batches", "5", "--batch-size", "16",
         "--no-progress", "--no-tensorboard", "--optimizer", "sgd", "--lr", "0.05", "--ema-decay", "0.9"]


@contextlib.contextmanager
def signal_after_step(step: int, sig: signal.Signals):
    """Send ``sig`` to this process right after the ``step``-th optimiser step (counted over every optimiser):
    the handler runs before the loop's next look at its flag, so the run stops after exactly that step."""
    count = [0]

    def hook(optimizer, args, kwargs):
        count[0] += 1
        if count[0] == step:
            signal.raise_signal(sig)

    handle = register_optimizer_step_post_hook(hook)
    try:
        yield count
    finally:
        handle.remove()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    ref = tmp_path_factory.mktemp("preempt") / "ref"
    assert main([*TRAIN, "--out", str(ref)]) == 0
    return ref


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signalled_train_run_saves_its_step_and_resumes_to_the_uninterrupted_weights(tmp_path, capsys, sig,
                                                                                       uninterrupted):
    ref = uninterrupted
    out = tmp_path / "stopped"
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with signal_after_step(7, sig):
        status = main([*TRAIN, "--out", str(out)])
    assert status == 128 + int(sig)  # as a shell reports a process ended by that signal
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert f"stopped by {sig.name} in epoch 2/2 after batch 2/5" in err and "--resume" in err
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == handlers  # restored

    saved = load_checkpoint(out / "last.pt")
    assert saved["epoch"] == 1 and saved["epoch_partial"]["batches"] == 2
    assert saved["epoch_partial"]["sums"]["n"] == 2 * 16  # the images of the epoch's first two batches
    assert saved["scheduler"]["last_epoch"] == 7  # the schedule stepped once per optimiser step
    assert len((out / "metrics.csv").read_text().strip().splitlines()) == 2  # header and epoch 1 only

    assert main(["train", "--out", str(out), "--resume", "--no-progress"]) == 0
    assert "epoch 2 from batch 3" in capsys.readouterr().out
    for name in ("model.safetensors", "model_ema.safetensors"):
        a, b = load_file(ref / name), load_file(out / name)
        assert a.keys() == b.keys()
        for key in a:  # the same operations in the same order in one process: bit for bit
            assert torch.equal(a[key], b[key]), (name, key)
    rows = [(out / "metrics.csv").read_text(), (ref / "metrics.csv").read_text()]
    ref_rows = [r.split(",") for r in rows[1].strip().splitlines()]
    got_rows = [r.split(",") for r in rows[0].strip().splitlines()]
    assert len(got_rows) == len(ref_rows) == 3
    header = ref_rows[0]
    for name in ("train_loss", "train_top1", "test_top1", "test_top1_ema"):  # epoch 2's sums carried over the stop
        i = header.index(name)
        assert [r[i] for r in got_rows[1:]] == [r[i] for r in ref_rows[1:]], name
    summaries = [json.loads((d / "summary.json").read_text()) for d in (out, ref)]
    assert summaries[0]["final_acc"] == summaries[1]["final_acc"]


@pytest.mark.parametrize("step", [1, 5])
def test_a_run_stopped_in_its_first_epoch_resumes(tmp_path, capsys, step, uninterrupted):
    """No epoch finished yet: the step-level checkpoint is the run's first, and --resume takes it; stopped
    after the epoch's last batch, the resumed epoch trains no batch and only finishes (the sums it saved)."""
    out = tmp_path / "early"
    with signal_after_step(step, signal.SIGTERM):
        assert main([*TRAIN, "--out", str(out)]) == 143
    assert f"in epoch 1/2 after batch {step}/5" in capsys.readouterr().err
    assert load_checkpoint(out / "last.pt")["epoch"] == 0
    assert main(["eval", "--checkpoint", str(out)]) == 0  # its weights named as trained: not "epoch 0"
    assert f"weights, epoch 0 and {step} batches of epoch 1) on digits test" in capsys.readouterr().out
    assert main(["train", "--out", str(out), "--resume", "--no-progress"]) == 0
    # the line says where it resumes: within the epoch, or at its end (not "from batch 6" of 5)
    expected = "epoch 1 from batch 2" if step == 1 else "epoch 1's end (its 5 batches done)"
    assert expected in capsys.readouterr().out
    assert json.loads((out / "summary.json").read_text())["epochs"] == 2
    rows = [(out / "metrics.csv").read_text().splitlines(), (uninterrupted / "metrics.csv").read_text().splitlines()]
    header = rows[0][0].split(",")
    for col in ("train_loss", "train_top1", "test_top1"):  # the epoch's sums carried across the stop
        i = header.index(col)
        assert [r.split(",")[i] for r in rows[0][1:]] == [r.split(",")[i] for r in rows[1][1:]], col


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_the_first_signal_is_acknowledged_on_a_terminal_only(tmp_path):
    """With ``notice=True`` (the main process of a run) a first SIGINT writes one line saying the run stops where it
    can be saved, when stderr (file descriptor 2) is a terminal, a pseudo-terminal here; redirected to a file,
    nothing is written (a log gets the run's own lines only). The signal is caught either way, and ``notice=False``
    is silent on a terminal."""

    def caught(notice: bool, terminal: bool) -> str:
        main_fd, side = os.openpty() if terminal else (None, os.open(tmp_path / "err.txt", os.O_RDWR | os.O_CREAT))
        saved = os.dup(2)
        os.dup2(side, 2)
        try:
            with StopSignals(notice=notice) as stop:
                signal.raise_signal(signal.SIGINT)
                assert stop.requested() is signal.SIGINT
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            os.close(side)
        if main_fd is None:
            return (tmp_path / "err.txt").read_text()
        said = b""
        while select.select([main_fd], [], [], 0.2)[0]:
            try:
                chunk = os.read(main_fd, 4096)
            except OSError:  # the terminal's other side is closed and drained
                break
            if not chunk:
                break
            said += chunk
        os.close(main_fd)
        return said.decode().replace("\r\n", "\n")  # the terminal's line discipline ends lines with \r\n

    assert caught(notice=True, terminal=True) == (
        "\nSIGINT: stopping where the run can be saved and resumed (after this step or evaluation); the same again "
        "(after a second) stops at once\n"
    )
    assert caught(notice=True, terminal=False) == ""
    assert caught(notice=False, terminal=True) == ""


def test_stop_signals_flag_restore_and_exit_status():
    before = signal.getsignal(signal.SIGTERM)
    with StopSignals() as stop:
        assert stop.requested() is None
        signal.raise_signal(signal.SIGTERM)  # handled: the process goes on
        assert stop.requested() is signal.SIGTERM
        signal.raise_signal(signal.SIGINT)  # the first signal is the one reported
        assert stop.requested() is signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before
    with StopSignals() as outer:  # a worker's own guard while it starts: the run's guard inherits its signal
        signal.raise_signal(signal.SIGTERM)
        with StopSignals() as inner:
            assert inner.requested() is signal.SIGTERM
        assert outer.requested() is signal.SIGTERM
    with StopSignals() as outer, StopSignals() as inner:
        assert inner.requested() is None
    assert signal.getsignal(signal.SIGTERM) is before
    assert exit_status(Preempted("stopped by SIGINT in epoch 1")) == 130
    assert exit_status(Preempted("stopped by SIGTERM in epoch 1")) == 143


def test_a_signalled_detect_run_stops_in_pretraining_and_in_an_epoch_and_resumes_exactly(tmp_path, capsys):
    """The detector's two phases: a signal in the glyph-crop pre-training saves pretrain.pt at that step, one
    in an epoch saves last.pt at that batch; each --resume continues there, and the run ends with the weights
    of one that never stopped."""
    pytest.importorskip("pycocotools")
    tiny = ["detect", "--backbone", "resnet26", "--epochs", "2", "--batch-size", "2", "--max-train-batches", "2",
            "--max-eval-images", "2", "--eval-batch-size", "2", "--img-size", "96", "--no-progress",
            "--no-tensorboard", "--pretrain-steps", "3", "--backbone-kwargs", "base_width=8", "--procs", "1",
            "--device", "cpu", "--detector",
            "{box_batch_size_per_image: 32, rpn_batch_size_per_image: 32, box_detections_per_img: 20}"]
    assert main([*tiny, "--out", str(tmp_path / "whole")]) == 0
    out = tmp_path / "stopped"
    with signal_after_step(2, signal.SIGTERM):  # pre-training step 2 of 3
        assert main([*tiny, "--out", str(out)]) == 143
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "in the pre-training after step 2/3" in err and "--resume" in err
    assert load_checkpoint(out / "pretrain.pt")["step"] == 2 and not (out / "last.pt").exists()
    with signal_after_step(2, signal.SIGTERM):  # pre-training step 3, then epoch 1's first batch
        assert main(["detect", "--out", str(out), "--resume"]) == 143
    assert "in epoch 1/2 after batch 1/2" in capsys.readouterr().err
    assert load_checkpoint(out / "last.pt")["epoch_partial"]["batches"] == 1
    assert main(["detect", "--out", str(out), "--resume"]) == 0
    assert "epoch 1 from batch 2" in capsys.readouterr().out
    whole, resumed = load_file(tmp_path / "whole" / "model.safetensors"), load_file(out / "model.safetensors")
    assert whole.keys() == resumed.keys()
    for key in whole:  # one process, the same operations in the same order: bit for bit
        assert torch.equal(whole[key], resumed[key]), key


@pytest.mark.slow
def test_sigterm_to_a_two_process_detect_run_reaches_its_workers(tmp_path):
    """``kill PID`` of ``lambdanet detect`` with two local processes: the launcher forwards the signal, both
    workers stop after the same step, the main one saves, and the command ends with one line and status 143;
    --resume then finishes the run from that batch."""
    import subprocess
    import sys
    import time

    pytest.importorskip("pycocotools")
    out = tmp_path / "run"
    args = [sys.executable, "-m", "lambdanet", "detect", "--backbone", "resnet26", "--epochs", "40", "--batch-size",
            "4", "--max-train-batches", "6", "--max-eval-images", "2", "--eval-batch-size", "2", "--img-size", "96",
            "--no-progress", "--no-tensorboard", "--pretrain-steps", "0", "--backbone-kwargs", "base_width=8",
            "--procs", "2", "--device", "cpu", "--out", str(out), "--detector",
            "{box_batch_size_per_image: 32, rpn_batch_size_per_image: 32, box_detections_per_img: 20}"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while time.time() < deadline and not (out / "metrics.csv").exists():  # epoch 1 is done
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 143, stderr
    lines = [line for line in stderr.splitlines() if line.startswith("lambdanet detect:")]
    # the signal lands inside epoch 2, or while epoch 1's end is still being written (its row is on disk first, then
    # its plots and checkpoint): either way one line that says which, and a last.pt that stands there
    assert len(lines) == 1 and "Traceback" not in stderr
    saved = load_checkpoint(out / "last.pt")
    if saved["epoch_partial"] is not None:
        assert f"stopped by SIGTERM in epoch {saved['epoch'] + 1}" in lines[0], lines[0]
    else:
        assert f"stopped by SIGTERM after epoch {saved['epoch']}/40" in lines[0] and saved["epoch"] >= 1, lines[0]
    assert main(["detect", "--out", str(out), "--resume"]) == 0
    assert json.loads((out / "summary.json").read_text())["epochs"] == 40


def _draws() -> tuple[torch.Tensor, float]:
    return torch.rand(4), random.random()


def _rng_round_trip(path: str) -> None:
    """One process of a group of two: draws a number of values that depends on its rank (as a detector's
    proposal sampling depends on its images), every process gathers its generators, the main one saves; the
    next draws are expected. Then, the generators scrambled, it restores that checkpoint, and one without the
    per-process states (as earlier versions wrote them), drawing after each."""
    from lambdanet.engine.distributed import barrier, cleanup, init_distributed
    from lambdanet.engine.state import RunState

    ctx = init_distributed("cpu")
    torch.manual_seed(0)  # every process seeded alike, as a run seeds them
    random.seed(0)
    model = torch.nn.Linear(2, 2)
    state = RunState(model, torch.optim.SGD(model.parameters(), lr=0.1), step=3)
    torch.rand(5 + 7 * ctx.rank)  # the processes draw differently many numbers
    [random.random() for _ in range(1 + ctx.rank)]
    state.gather_rng(ctx)
    if ctx.is_main:
        state.save(f"{path}/last.pt")
        old = {k: v for k, v in load_checkpoint(f"{path}/last.pt").items() if k != "rng_ranks"}
        torch.save(old, f"{path}/old.pt")
    barrier(ctx)
    expected = _draws()
    state.step += 1  # a later save without a gather keeps no stale per-process states
    stale = "rng_ranks" in state.state_dict()
    restored = {}
    for name in ("last", "old"):
        torch.manual_seed(123)
        random.seed(123)
        state.load_state_dict(load_checkpoint(f"{path}/{name}.pt"))
        restored[name] = _draws()
    torch.save({"expected": expected, "restored": restored, "stale": stale}, f"{path}/rank{ctx.rank}.pt")
    cleanup(ctx, synchronize=True)


def test_every_process_of_a_group_gets_its_own_generators_back(tmp_path):
    """A checkpoint of a process group keeps every process's RNG states and each process restores its own:
    a resumed group draws what it would have drawn (resuming with the main process's generators everywhere,
    a detector's other processes sampled other proposals: issue 40). A checkpoint without them (earlier
    versions), or resumed by one process, gives the main process's generators, as before."""
    from lambdanet.engine.distributed import launch_local
    from lambdanet.engine.state import RunState

    launch_local(_rng_round_trip, (str(tmp_path),), 2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    main_draws = ranks[0]["expected"]
    assert not torch.equal(main_draws[0], ranks[1]["expected"][0])  # the processes' generators had drifted apart
    assert main_draws[1] != ranks[1]["expected"][1]
    for rank in ranks:
        got = rank["restored"]["last"]
        assert torch.equal(got[0], rank["expected"][0]) and got[1] == rank["expected"][1]  # its own, exactly
        old = rank["restored"]["old"]
        assert torch.equal(old[0], main_draws[0]) and old[1] == main_draws[1]  # the main process's
        assert not rank["stale"]
    saved = load_checkpoint(tmp_path / "last.pt")
    assert len(saved["rng_ranks"]) == 2
    model = torch.nn.Linear(2, 2)
    RunState(model, torch.optim.SGD(model.parameters(), lr=0.1)).load_state_dict(saved)  # one process resumes it
    got = _draws()
    assert torch.equal(got[0], main_draws[0]) and got[1] == main_draws[1]


def _group_member(args: list[str], status: int, stop_after: int = 0) -> None:
    """One of launch_local's processes (as torchrun starts them): ``lambdanet ARGS`` in its place in the group,
    sending itself SIGINT after its ``stop_after``-th optimiser step (a terminal's Ctrl-C reaches every process
    of the group), ending with exit status ``status``."""
    with signal_after_step(stop_after, signal.SIGINT):
        got = main(args)
    assert got == status, (args, got)


# 2 processes, 2 epochs of 3 batches: stopped after step 5, epoch 2 after its batch 2
TWO_PROCESS_RUNS = {
    "detect": ["detect", "--backbone", "resnet26", "--epochs", "2", "--batch-size", "4", "--max-train-batches", "3",
               "--max-eval-images", "2", "--eval-batch-size", "2", "--img-size", "96", "--no-progress",
               "--no-tensorboard", "--pretrain-steps", "0", "--backbone-kwargs", "base_width=8", "--procs", "2",
               "--device", "cpu", "--detector",
               "{box_batch_size_per_image: 32, rpn_batch_size_per_image: 32, box_detections_per_img: 20}"],
    "train": ["train", "--model", "resnet26", "--epochs", "2", "--max-train-batches", "3", "--batch-size", "16",
              "--no-progress", "--no-tensorboard", "--optimizer", "sgd", "--lr", "0.05", "--ema-decay", "0.9",
              "--drop-path-rate", "0.1", "--device", "cpu"],  # stochastic depth: draws on every step
}


@pytest.mark.slow  # about a minute each on 2 cores
@pytest.mark.parametrize("command", ["detect", "train"])
def test_a_two_process_run_stopped_in_epoch_2_resumes_to_the_uninterrupted_weights(tmp_path, capfd, command):
    """Two processes (``detect --procs 2``; ``train`` as under torchrun), SIGINT in epoch 2, ``--resume``: every
    tensor of the final weights equals the uninterrupted two-process run's (issue 40: a detector's processes
    sample proposals from their own images, so each needs its own generators back; 36 of 254 tensors agreed)."""
    from safetensors.torch import load_file

    from lambdanet.engine.distributed import launch_local

    if command == "detect":
        pytest.importorskip("pycocotools")
    args, whole, out = TWO_PROCESS_RUNS[command], tmp_path / "whole", tmp_path / "stopped"
    if command == "detect":  # the launcher of --procs 2
        assert main([*args, "--out", str(whole)]) == 0
    else:
        launch_local(_group_member, ([*args, "--out", str(whole)], 0), 2)
    launch_local(_group_member, ([*args, "--out", str(out)], 130, 5), 2)
    saved = load_checkpoint(out / "last.pt")
    assert saved["epoch"] == 1 and saved["epoch_partial"]["batches"] == 2 and len(saved["rng_ranks"]) == 2
    capfd.readouterr()
    resume = [command, "--out", str(out), "--resume"]
    if command == "detect":
        assert main(resume) == 0
    else:
        launch_local(_group_member, (resume, 0), 2)
    printed = capfd.readouterr().out
    assert "epoch 2 from batch 3" in printed and (command == "train" or "2 local processes" in printed)
    names = ["model.safetensors"] + (["model_ema.safetensors"] if command == "train" else [])
    for name in names:
        a, b = load_file(whole / name), load_file(out / name)
        assert a.keys() == b.keys()
        for key in a:  # the same operations in the same order on each process: bit for bit
            assert torch.equal(a[key], b[key]), (name, key)
    rows = [(d / "metrics.csv").read_text().splitlines() for d in (out, whole)]
    i = rows[1][0].split(",").index("train_loss")  # epoch 2's sums carried over the stop
    assert [r.split(",")[i] for r in rows[0][1:]] == [r.split(",")[i] for r in rows[1][1:]]


def test_processes_agree_on_what_they_knew_when_they_entered_the_reduce(monkeypatch):
    """A signal that lands while this process waits in the agreement's all-reduce (the others having seen no
    signal: the reduce sums to 0) counts at the next step; answering with it now would stop this process
    alone and leave the others waiting in the next step's collectives."""
    from lambdanet.engine import preempt
    from lambdanet.engine.distributed import DistContext

    ctx = DistContext(rank=1, world=2)
    seen = []

    def reduce_during_which_a_signal_lands(values, ctx):
        seen.append(values[0])
        signal.raise_signal(signal.SIGTERM)  # handled on return from this call, as after a blocking reduce
        return [values[0] + 0.0]  # the other process saw nothing

    monkeypatch.setattr(preempt, "all_reduce_sum", reduce_during_which_a_signal_lands)
    with StopSignals() as stop:
        assert stop.requested(ctx) is None and seen == [0.0]  # not now...
        assert stop.requested(ctx) is signal.SIGTERM and seen[-1] == 1.0  # ...at the next step, everywhere
    monkeypatch.setattr(preempt, "all_reduce_sum", lambda values, ctx: [values[0] + 1.0])  # another saw one
    with StopSignals() as stop:
        assert stop.requested(ctx) is signal.SIGTERM  # stops with the others, reported as SIGTERM


def test_a_second_ctrl_c_interrupts_at_once(monkeypatch):
    from lambdanet.engine import preempt

    # Python's handler, as a run started from a terminal has it (a shell's background job starts with SIGINT ignored)
    outside = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with StopSignals() as stop:
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)  # the same press delivered twice (group + forwarding): no effect
            assert stop.requested() is signal.SIGINT
            monkeypatch.setattr(preempt, "REPEAT_WINDOW_S", -1.0)  # a later press
            with pytest.raises(KeyboardInterrupt):
                signal.raise_signal(signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, outside)


@pytest.mark.parametrize("how", ["signal", "ctrl-c twice", "error"])
def test_a_stop_or_a_failure_while_an_epoch_evaluates_keeps_its_training_and_resumes_exactly(tmp_path, capsys,
                                                                                             monkeypatch, how,
                                                                                             uninterrupted):
    """Epoch 1 trained, its evaluation then: a signal (heard, not acted on until the evaluation ends) saves the
    epoch and stops there; Ctrl-C twice (``KeyboardInterrupt`` inside it) or an error (an unreadable image, out of
    memory) saves the epoch's training as a signal after its last batch would, so ``--resume`` evaluates it again
    instead of losing it. Each resumed run ends with the weights and figures of one that never stopped."""
    from lambdanet.tasks.classification import task as classification_task

    real, calls = classification_task.evaluate, [0]

    def evaluate(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 1:  # epoch 1's test split
            if how == "signal":
                signal.raise_signal(signal.SIGINT)
            elif how == "ctrl-c twice":
                raise KeyboardInterrupt
            else:
                raise ValueError("image 3.png is not a readable image")
        return real(*args, **kwargs)

    monkeypatch.setattr(classification_task, "evaluate", evaluate)
    out = tmp_path / "stopped"
    status = main([*TRAIN, "--out", str(out)])
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    saved = load_checkpoint(out / "last.pt")
    if how == "signal":  # the evaluation ran to its end: the epoch is closed and its row written
        assert status == 130 and "stopped by SIGINT after epoch 1/2: saved" in err and "--resume" in err
        assert saved["epoch"] == 1 and not saved["epoch_partial"]
        assert len((out / "metrics.csv").read_text().strip().splitlines()) == 2
    else:
        assert saved["epoch"] == 0 and saved["epoch_partial"]["batches"] == 5
        assert saved["epoch_partial"]["sums"]["n"] == 5 * 16 and saved["samples_seen"] == 0
        if how == "error":
            assert status == 2 and "image 3.png is not a readable image" in err
            assert "--resume evaluates it again" in captured.out
        else:
            assert status == 130 and "stopped by SIGINT while evaluating epoch 1/2: saved" in err
    monkeypatch.setattr(classification_task, "evaluate", real)
    assert main(["train", "--out", str(out), "--resume", "--no-progress"]) == 0
    for name in ("model.safetensors", "model_ema.safetensors"):
        a, b = load_file(uninterrupted / name), load_file(out / name)
        assert all(torch.equal(a[key], b[key]) for key in a), name
    rows = [(d / "metrics.csv").read_text().splitlines() for d in (out, uninterrupted)]
    header = rows[1][0].split(",")
    for col in ("epoch", "train_loss", "test_top1", "test_top1_ema"):  # one row per epoch, the same figures
        i = header.index(col)
        assert [r.split(",")[i] for r in rows[0][1:]] == [r.split(",")[i] for r in rows[1][1:]], col
    summaries = [json.loads((d / "summary.json").read_text()) for d in (out, uninterrupted)]
    for key in ("final_acc", "epochs", "best_acc", "best_epoch"):
        assert summaries[0][key] == summaries[1][key], key


def test_ctrl_c_twice_in_the_final_evaluation_is_one_line_and_resume_ends_the_run(tmp_path, capsys, monkeypatch,
                                                                                  uninterrupted):
    """The last epoch is saved before the run's final evaluation (``Task.finish``): Ctrl-C twice there is one line
    that says so, and ``--resume`` writes the final files of the run that never stopped."""
    from lambdanet.tasks.classification.task import ClassificationTask

    real = ClassificationTask.finish

    def interrupted(self, *args):
        raise KeyboardInterrupt

    monkeypatch.setattr(ClassificationTask, "finish", interrupted)
    out = tmp_path / "final"
    assert main([*TRAIN, "--out", str(out)]) == 130
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "stopped by SIGINT in the run's final evaluation: saved" in err
    assert not (out / "summary.json").exists() and load_checkpoint(out / "last.pt")["epoch"] == 2
    monkeypatch.setattr(ClassificationTask, "finish", real)
    assert main(["train", "--out", str(out), "--resume", "--no-progress"]) == 0
    a, b = load_file(uninterrupted / "model.safetensors"), load_file(out / "model.safetensors")
    assert all(torch.equal(a[key], b[key]) for key in a)


def test_a_run_stopped_in_the_epoch_that_stops_early_resumes_to_its_end_not_past_it(tmp_path, capsys, monkeypatch):
    """A signal while the epoch that stops the run early (``--early-stop-patience``) is evaluated stops it there
    (saved), and Ctrl-C twice in the final evaluation after an early stop stops it too; ``--resume`` then ends the
    run where it stopped early, with the weights of the run that never stopped (no epoch trained past it)."""
    from lambdanet.tasks.classification.task import ClassificationTask

    args = ["train", "--model", "resnet26", "--epochs", "6", "--max-train-batches", "2", "--batch-size", "16",
            "--no-progress", "--no-tensorboard", "--val-split", "0.1", "--early-stop-patience", "1", "--lr", "5",
            "--optimizer", "sgd"]  # fmt: skip
    whole = tmp_path / "whole"
    assert main([*args, "--out", str(whole)]) == 0
    expected = json.loads((whole / "summary.json").read_text())
    assert expected["stopped_early"] and expected["epochs"] < 6  # else the test shows nothing
    real = ClassificationTask.stops_early

    def signalled(self, state):
        if state.epoch == expected["epochs"]:  # while the epoch that stops early is evaluated and judged
            signal.raise_signal(signal.SIGINT)
        return real(self, state)

    monkeypatch.setattr(ClassificationTask, "stops_early", signalled)
    out = tmp_path / "signalled"
    assert main([*args, "--out", str(out)]) == 130
    assert f"after epoch {expected['epochs']}/6" in capsys.readouterr().err
    monkeypatch.setattr(ClassificationTask, "stops_early", real)

    def interrupted(self, *rest):
        raise KeyboardInterrupt

    monkeypatch.setattr(ClassificationTask, "finish", interrupted)
    final = tmp_path / "final"
    assert main([*args, "--out", str(final)]) == 130
    monkeypatch.undo()
    for run in (out, final):
        assert main(["train", "--out", str(run), "--resume", "--no-progress"]) == 0
        summary = json.loads((run / "summary.json").read_text())
        assert (summary["epochs"], summary["stopped_early"]) == (expected["epochs"], True)
        a, b = load_file(whole / "model.safetensors"), load_file(run / "model.safetensors")
        assert all(torch.equal(a[key], b[key]) for key in a)
