"""``lambdanet detect`` (lambdanet.detection.trainer): a run end to end on the built-in glyph scenes, resume,
the recipes and the learning-rate schedule of LambdaNetworks App. E.3."""

import json
import math

import pytest

pytest.importorskip("pycocotools")

from lambdanet.cli import main  # noqa: E402
from lambdanet.detection.trainer import DETECT_RECIPES, lr_factor, resolve_detect_config  # noqa: E402

# one step of batch 2 at 96 px, two test images, light heads: a smoke run of the whole pipeline
TINY = ["--epochs", "1", "--batch-size", "2", "--max-train-batches", "1", "--max-eval-images", "2",
        "--eval-batch-size", "2", "--img-size", "96", "--no-progress", "--no-tensorboard", "--pretrain-steps", "0",
        "--backbone-kwargs", "base_width=8", "--detector",
        "{box_batch_size_per_image: 32, rpn_batch_size_per_image: 32, box_detections_per_img: 20}"]
AP_KEYS = [f"{t}_{m}" for t in ("bbox", "segm") for m in ("AP", "AP50", "AP75", "AP_small", "AP_medium", "AP_large")]


def test_detect_trains_evaluates_and_writes_the_run(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["detect", "--backbone", "lambda_resnet26", *TINY, "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    for key in AP_KEYS:  # COCO metrics as fractions (nan: no object of that size among the images evaluated)
        assert key in summary and (math.isnan(summary[key]) or 0.0 <= summary[key] <= 1.0), key
    assert summary["backbone"] == "lambda_resnet26" and summary["epochs"] == 1 and summary["params"] > 0
    for name in ("config.yaml", "last.pt", "metrics.csv", "loss.png", "predictions.png", "model.safetensors"):
        assert (out / name).is_file(), name
    assert "box AP" in capsys.readouterr().out


def test_detect_resume_continues_and_refuses_changes(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["detect", "--backbone", "resnet26", *TINY, "--out", str(out)]
    assert main(args) == 0
    assert main(args) == 2  # the run exists: --resume or another --out
    assert "already holds a run" in capsys.readouterr().err
    assert main([*args[:-2], "--out", str(out), "--resume", "--epochs", "2"]) == 0
    rows = (out / "metrics.csv").read_text().strip().splitlines()
    assert len(rows) == 3 and rows[2].startswith("2,")  # header + epochs 1 and 2
    assert main(["detect", "--out", str(out), "--resume", "--lr", "0.5"]) == 2
    assert "cannot change lr" in capsys.readouterr().err


def test_paper_recipe_is_app_e3():
    cfg = resolve_detect_config("paper", overrides={"batch_size": 64})
    assert (cfg.img_size, cfg.jitter_min, cfg.jitter_max) == (1024, 0.1, 2.0)
    assert cfg.optimizer == "sgd" and cfg.weight_decay == 4e-5 and cfg.sync_bn and cfg.warmup_steps == 1000
    assert cfg.effective_lr() == pytest.approx(0.32 * 64 / 256) and cfg.lr_steps == [0.9, 0.95, 0.975]
    assert cfg.epochs == math.ceil(130_000 * 256 / 118_287) and cfg.pretrain_steps == 0  # from scratch, >= 130k steps
    assert set(DETECT_RECIPES) == {"quick", "paper"}


def test_lr_schedule_warms_up_then_steps_down_tenfold():
    total, warm = 1000, 100
    assert lr_factor(0, total, warm, [0.9, 0.95, 0.975]) == pytest.approx(1e-3)
    assert lr_factor(50, total, warm, [0.9, 0.95, 0.975]) == pytest.approx(1e-3 + (1 - 1e-3) * 0.5)
    assert lr_factor(899, total, warm, [0.9, 0.95, 0.975]) == 1.0
    assert lr_factor(900, total, warm, [0.9, 0.95, 0.975]) == pytest.approx(0.1)
    assert lr_factor(960, total, warm, [0.9, 0.95, 0.975]) == pytest.approx(0.01)
    assert lr_factor(999, total, warm, [0.9, 0.95, 0.975]) == pytest.approx(0.001)


@pytest.mark.parametrize("args,needle", [
    (["--data", "voc"], "unknown detection dataset 'voc'"),
    (["--jitter-min", "2", "--jitter-max", "1"], "jitter_min and jitter_max"),
    (["--backbone", "resnet51"], "unknown backbone 'resnet51'"),
])
def test_bad_detect_arguments_fail_on_one_line(tmp_path, capsys, args, needle):
    assert main(["detect", *args, *TINY, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_metrics_csv_takes_rows_with_new_columns(tmp_path):
    """detect evaluates every few epochs: a row with AP columns after rows without them widens the header
    (the file is rewritten), rows without them leave empty cells, and reading skips those cells."""
    from lambdanet.train.logger import RunLogger, read_history, truncate_history

    logger = RunLogger(tmp_path, tensorboard=False)
    logger.log_epoch({"epoch": 1, "train_loss": 2.5})
    logger.log_epoch({"epoch": 2, "train_loss": 2.0, "bbox_AP": 0.25})
    logger.log_epoch({"epoch": 3, "train_loss": 1.5, "steps": 186})
    path = tmp_path / "metrics.csv"
    lines = path.read_text().splitlines()
    assert lines == ["epoch,train_loss,bbox_AP,steps", "1,2.5,,", "2,2.0,0.25,", "3,1.5,,186"]  # cells as written
    assert read_history(path) == [{"epoch": 1, "train_loss": 2.5}, {"epoch": 2, "train_loss": 2.0, "bbox_AP": 0.25},
                                  {"epoch": 3, "train_loss": 1.5, "steps": 186}]
    truncate_history(path, 2)
    assert path.read_text().splitlines() == lines[:3]


def test_local_processes_rule(monkeypatch):
    from lambdanet.detection import trainer

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(trainer, "usable_cores", lambda: 2)
    quick = resolve_detect_config(overrides={"device": "cpu"})
    assert trainer.local_processes(quick) == 2  # batch 8 on 2 cores: one process per core, 4 images each
    assert trainer.local_processes(resolve_detect_config(overrides={"device": "cpu", "batch_size": 4})) == 1
    odd = resolve_detect_config(overrides={"device": "cpu", "batch_size": 9})
    assert trainer.local_processes(odd) == 1  # 2 processes would not divide the batch of 9
    monkeypatch.setattr(trainer, "usable_cores", lambda: 4)
    assert trainer.local_processes(resolve_detect_config(overrides={"device": "cpu", "batch_size": 12})) == 3
    monkeypatch.setattr(trainer, "usable_cores", lambda: 2)
    assert trainer.local_processes(resolve_detect_config(overrides={"device": "cpu", "procs": 3})) == 3
    monkeypatch.setattr(trainer, "usable_cores", lambda: 1)
    assert trainer.local_processes(quick) == 1
    monkeypatch.setattr(trainer, "usable_cores", lambda: 16)
    assert trainer.local_processes(resolve_detect_config(overrides={"device": "cpu", "batch_size": 64})) == 16
    monkeypatch.setenv("WORLD_SIZE", "2")  # started by torchrun: never launches more
    assert trainer.local_processes(quick) == 1
    with pytest.raises(ValueError, match="procs must be a non-negative int"):
        resolve_detect_config(overrides={"procs": -1})


def test_detect_on_two_local_processes(tmp_path, capfd):
    """Two processes share out the batch and the pre-training crops; the main one writes the run, and a user
    error is one line in the launching process."""
    out = tmp_path / "run"
    args = ["detect", "--backbone", "resnet26", *TINY, "--pretrain-steps", "2", "--procs", "2", "--device", "cpu",
            "--out", str(out)]
    assert main(args) == 0
    printed = capfd.readouterr().out
    assert "2 local processes" in printed and printed.count("pre-training resnet26") == 1  # the main one prints
    summary = json.loads((out / "summary.json").read_text())
    assert summary["epochs"] == 1 and 0.0 <= summary["pretrain_accuracy"] <= 1.0
    for key in AP_KEYS:
        assert math.isnan(summary[key]) or 0.0 <= summary[key] <= 1.0, key
    assert main(args) == 2
    assert "already holds a run" in capfd.readouterr().err
    assert main([*args[:-2], "--batch-size", "3", "--out", str(tmp_path / "odd")]) == 2
    assert "must be a multiple of procs 2" in capfd.readouterr().err
