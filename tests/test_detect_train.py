"""``lambdanet detect`` (lambdanet.tasks.detection.task): a run end to end on the built-in glyph scenes, resume,
the recipes and the learning-rate schedule of LambdaNetworks App. E.3."""

import json
import math

import pytest
import torch

pytest.importorskip("pycocotools")

from lambdanet.cli import main  # noqa: E402
from lambdanet.tasks.detection.config import DETECT_RECIPES, lr_factor, resolve_detect_config  # noqa: E402

# one step of batch 2 at 96 px, two test images, light heads: a smoke run of the whole pipeline
TINY = ["--epochs", "1", "--batch-size", "2", "--max-train-batches", "1", "--max-eval-images", "2",
        "--eval-batch-size", "2", "--img-size", "96", "--no-progress", "--no-tensorboard", "--pretrain-steps", "0",
        "--backbone-kwargs", "base_width=8", "--detector",
        "{box_batch_size_per_image: 32, rpn_batch_size_per_image: 32, box_detections_per_img: 20}"]
AP_KEYS = [f"{t}_{m}" for t in ("bbox", "segm") for m in ("AP", "AP50", "AP75", "AP_small", "AP_medium", "AP_large")]


def test_detect_trains_evaluates_and_writes_the_run(tmp_path, capsys):
    out = tmp_path / "run"
    with_progress = [a for a in TINY if a != "--no-progress"]  # bars asked for, output not a terminal
    assert main(["detect", "--backbone", "lambda_resnet26", *with_progress, "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    for key in AP_KEYS:  # COCO metrics as fractions (nan: no object of that size among the images evaluated)
        assert key in summary and (math.isnan(summary[key]) or 0.0 <= summary[key] <= 1.0), key
    assert summary["backbone"] == "lambda_resnet26" and summary["epochs"] == 1 and summary["params"] > 0
    for name in ("config.yaml", "last.pt", "metrics.csv", "loss.png", "predictions.png", "model.safetensors"):
        assert (out / name).is_file(), name
    printed = capsys.readouterr()
    assert "box AP" in printed.out
    assert "resuming" not in printed.out  # a fresh run resumes nothing
    # a log (stdout and stderr are not terminals here) gets lines, not carriage-return redraws of progress bars
    assert "\r" not in printed.out + printed.err and "it/s" not in printed.err


def test_detect_resume_continues_and_refuses_changes(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["detect", "--backbone", "resnet26", *TINY, "--out", str(out)]
    assert main(args) == 0
    assert main(args) == 2  # the run exists: --resume or another --out
    assert "already holds a run" in capsys.readouterr().err
    assert main([*args[:-2], "--out", str(out), "--resume", "--epochs", "3", "--eval-every", "2"]) == 0
    rows = [row.split(",") for row in (out / "metrics.csv").read_text().strip().splitlines()]
    assert [row[0] for row in rows[1:]] == ["1", "2", "3"]  # epochs 1-3, each once
    ap = rows[0].index("bbox_AP")
    assert [bool(row[ap]) for row in rows[1:]] == [True, True, True]  # the first run's last, then 2 and the last
    assert main(["detect", "--out", str(out), "--resume", "--lr", "0.5"]) == 2
    err = capsys.readouterr().err
    assert "cannot change lr" in err and err.count("--epochs") == 1  # the options it may change, each named once


def test_crashes_in_and_after_pretraining_resume_to_the_uninterrupted_weights(tmp_path, monkeypatch, capsys, power_cut):
    """A run saves its pre-training as it goes (pretrain.pt) and ends it with an epoch-0 last.pt: a run that
    dies in the pre-training, then in epoch 1, then in epoch 2, resumes each time without repeating work and
    (the data order a function of seed and epoch, the RNG restored) ends with exactly the weights of a run
    that never stopped."""
    from safetensors.torch import load_file

    from lambdanet.tasks.detection import task as trainer

    args = ["detect", "--backbone", "resnet26", *TINY, "--pretrain-steps", "2", "--epochs", "2", "--procs", "1",
            "--device", "cpu"]  # 2 pre-training steps, then 1 step per epoch
    assert main([*args, "--out", str(tmp_path / "whole")]) == 0
    whole = load_file(tmp_path / "whole" / "model.safetensors")
    out = tmp_path / "crashed"

    monkeypatch.setattr(trainer, "PRETRAIN_CHECKPOINT_EVERY", 1)
    with power_cut(2), pytest.raises(RuntimeError, match="power cut"):  # pre-training step 1 saved, step 2 dies
        main([*args, "--out", str(out)])
    assert (out / "pretrain.pt").is_file() and not (out / "last.pt").exists()
    assert main([*args, "--out", str(out)]) == 2  # not over it: --resume
    assert "already holds a run (pretrain.pt)" in capsys.readouterr().err

    with power_cut(2), pytest.raises(RuntimeError, match="power cut"):  # the pre-training's last step, then epoch 1
        main(["detect", "--out", str(out), "--resume"])
    assert f"continuing the pre-training from {out / 'pretrain.pt'}: 1/2 steps done" in capsys.readouterr().out
    assert (out / "last.pt").is_file() and (out / "pretrain.json").is_file() and not (out / "pretrain.pt").exists()

    with power_cut(2), pytest.raises(RuntimeError, match="power cut"):  # epoch 1 trains, epoch 2 dies
        main(["detect", "--out", str(out), "--resume"])
    assert "0/2 epochs done" in capsys.readouterr().out
    monkeypatch.undo()
    assert main(["detect", "--out", str(out), "--resume"]) == 0
    printed = capsys.readouterr().out
    assert "1/2 epochs done" in printed and "pre-training" not in printed
    resumed = load_file(out / "model.safetensors")
    assert resumed.keys() == whole.keys()
    for name, tensor in whole.items():  # the same operations in the same order on one process: bit for bit
        assert torch.equal(resumed[name], tensor), name
    summaries = [json.loads((run / "summary.json").read_text()) for run in (out, tmp_path / "whole")]
    assert summaries[0]["pretrain_accuracy"] == summaries[1]["pretrain_accuracy"]


def test_torchrun_batch_must_divide_among_the_processes(tmp_path, monkeypatch):
    """Under torchrun each process takes batch_size / world images: a batch the processes do not divide is a
    one-line error, not a silently smaller batch."""
    monkeypatch.setenv("WORLD_SIZE", "3")  # as torchrun --nproc-per-node 3 sets it
    with pytest.raises(ValueError, match="batch_size 8 must be a multiple of the 3 processes"):
        resolve_detect_config(overrides={"device": "cpu", "batch_size": 8, "out": str(tmp_path / "run")})
    assert resolve_detect_config(overrides={"batch_size": 9}).batch_size == 9
    assert not (tmp_path / "run").exists()


def test_a_diverging_detector_stops_with_a_one_line_error(tmp_path, monkeypatch, capsys):
    from lambdanet.tasks.detection import task as trainer

    build = trainer.build_detector

    def nan_losses(cfg, num_classes):  # the detector's training losses turn NaN, as after a too-high lr
        model = build(cfg, num_classes)
        forward = model.forward
        model.forward = lambda images, targets=None: (
            {k: v * float("nan") for k, v in forward(images, targets).items()} if model.training
            else forward(images, targets))
        return model

    monkeypatch.setattr(trainer, "build_detector", nan_losses)
    assert main(["detect", "--backbone", "resnet26", *TINY, "--procs", "1", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert "loss became nan at epoch 1, step 1; training stopped" in err and "Lower --lr" in err
    assert len(err.splitlines()) == 1


def test_paper_recipe_is_app_e3():
    cfg = resolve_detect_config("paper", overrides={"batch_size": 64})
    assert (cfg.img_size, cfg.jitter_min, cfg.jitter_max) == (1024, 0.1, 2.0)
    assert cfg.optimizer == "sgd" and cfg.weight_decay == 4e-5 and cfg.sync_bn and cfg.warmup_steps == 1000
    assert cfg.effective_lr() == pytest.approx(0.32 * 64 / 256) and cfg.lr_steps == [0.9, 0.95, 0.975]
    assert cfg.epochs == math.ceil(130_000 * 256 / 118_287) and cfg.pretrain_steps == 0  # from scratch, >= 130k steps
    assert set(DETECT_RECIPES) == {"quick", "paper"}


def test_evaluation_comes_after_the_last_epoch_and_every_eval_every():
    def evaluated(**overrides):
        cfg = resolve_detect_config(overrides=overrides)
        return [epoch for epoch in range(1, cfg.epochs + 1) if cfg.evaluates_after(epoch)]

    assert evaluated(epochs=24) == [24]  # the default: once, after the last epoch
    assert evaluated(epochs=24, eval_every=9) == [9, 18, 24]
    assert evaluated(epochs=3, eval_every=1) == [1, 2, 3]
    with pytest.raises(ValueError, match=r"eval_every must be a non-negative int \(0: after the last epoch only\), "
                                         "got -1"):
        resolve_detect_config(overrides={"eval_every": -1})


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
    from lambdanet.engine.logger import RunLogger, read_history, truncate_history

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
    from lambdanet.tasks.detection import task as trainer

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


def test_loss_weights_scale_the_losses_trained_on(tmp_path):
    """A loss weighted 0 trains nothing that only it reaches: the mask predictor's bias (1-d, so without
    AdamW's weight decay) keeps its initial value, while the box predictor's moves; weighted 1 (the default)
    the mask bias moves too."""
    from safetensors.torch import load_file

    from lambdanet.tasks.detection.data import GlyphSceneConfig, build_detection_datasets
    from lambdanet.tasks.detection.task import build_detector

    args = ["detect", "--backbone", "resnet26", *TINY, "--procs", "1", "--device", "cpu"]
    cfg = resolve_detect_config(overrides={"backbone": "resnet26", "pretrain_steps": 0, "img_size": 96,
                                           "backbone_kwargs": {"base_width": 8},
                                           "detector": {"box_batch_size_per_image": 32, "rpn_batch_size_per_image": 32,
                                                        "box_detections_per_img": 20}})
    torch.manual_seed(cfg.seed)  # as a run builds its detector: seeded, after the scenes are read
    train, _ = build_detection_datasets("glyphs", seed=cfg.seed, config=GlyphSceneConfig(glyphs=cfg.glyphs))
    initial = build_detector(cfg, train.num_classes).state_dict()
    mask_bias, box_bias = "roi_heads.mask_predictor.mask_fcn_logits.bias", "roi_heads.box_predictor.cls_score.bias"
    for weights, mask_moves in (("{loss_mask: 0}", False), ("{}", True)):
        out = tmp_path / f"run{int(mask_moves)}"
        assert main([*args, "--loss-weights", weights, "--out", str(out)]) == 0
        trained = load_file(out / "model.safetensors")
        assert not torch.equal(trained[box_bias], initial[box_bias])
        assert torch.equal(trained[mask_bias], initial[mask_bias]) is not mask_moves, weights
    assert main([*args, "--loss-weights", "{loss_mask: -1}", "--out", str(tmp_path / "bad")]) == 2


def test_detect_resume_refuses_a_coco_folder_whose_categories_changed(tmp_path, capsys):
    """Label k is the training file's k-th category: ids renumbered after the run would relabel it silently."""
    from test_detection import write_coco_folder

    data, out = tmp_path / "coco", tmp_path / "run"
    write_coco_folder(data)
    args = ["detect", "--backbone", "resnet26", "--data", f"coco:{data}", *TINY, "--out", str(out)]
    assert main(args) == 0
    for split in ("train", "val"):  # the ids 3 and 7 swapped: "cat" is label 2 now
        path = data / "annotations" / f"instances_{split}.json"
        path.write_text(path.read_text().replace('"id": 3', '"id": 99').replace('"id": 7', '"id": 3')
                        .replace('"id": 99', '"id": 7'))  # fmt: skip
    capsys.readouterr()
    assert main(["detect", "--out", str(out), "--resume", "--epochs", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "was trained on the categories [[3, 'cat'], [7, 'dog']]" in err and "[[3, 'dog'], [7, 'cat']]" in err
    assert "\n" not in err
