"""What a new user meets: resolved configs, resume, sweeps, the run-directory lock, offline data, clear errors
and help (issue 14)."""

import json
import os
import subprocess
import sys
import time
import urllib.error

import pytest
import yaml

from lambdanet.tasks.classification import datasets as D
from lambdanet.cli import build_parser, main
from lambdanet.tasks.classification import resolve_config, train
from lambdanet.engine.checkpoint import CheckpointError, load_checkpoint
from lambdanet.tasks.classification.config import TrainConfig
from lambdanet.engine.rundir import RunDirBusyError, RunDirLock

FAST = dict(epochs=2, max_train_batches=2, batch_size=32, progress=False, tensorboard=False)
ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "lambdanet", *args], capture_output=True, text=True, timeout=300,
                          env=ENV)


# ----------------------------------------------------------------------------------- resolved configuration


def test_config_yaml_is_the_configuration_that_ran(tmp_path):
    out = tmp_path / "run"
    summary = train(resolve_config(overrides={**FAST, "epochs": 1, "out": str(out), "drop_rate": 0.1}))
    saved = yaml.safe_load((out / "config.yaml").read_text())
    # everything the run used is written in: the data's image size, the small-image stem and compact width the
    # trainer chose, the dropout; nothing is left for the trainer to decide
    assert saved["img_size"] == 16 and saved["drop_rate"] == 0.1 and saved["drop_path_rate"] == 0.0
    assert saved["model_kwargs"] == {"stem": "cifar", "base_width": 16, "img_size": 16}
    # the model rebuilt from config.yaml alone has the run's parameter count and loads its weights strictly
    cfg = TrainConfig(**saved)
    from lambdanet.tasks.classification.task import build_model_for

    model = build_model_for(cfg, D.dataset_spec(cfg.data))
    assert sum(p.numel() for p in model.parameters()) == summary["params"]
    model.load_state_dict(load_checkpoint(out / "last.pt")["model"])
    assert summary["num_classes"] == 10 and summary["in_chans"] == 1


def test_paper350_config_yaml_has_table20_values(tmp_path):
    cfg = resolve_config("paper350", overrides={"model": "lambda_resnet50"})
    path = tmp_path / "config.yaml"
    from lambdanet.engine.config import save_yaml

    save_yaml(cfg, path)
    saved = yaml.safe_load(path.read_text())
    # LambdaNetworks Tables 19-20, LambdaResNet-50: trained at 160 px with RandAugment 10 and dropout 0.2
    assert (saved["img_size"], saved["randaugment_magnitude"], saved["drop_rate"]) == (160, 10, 0.2)
    assert saved["model_kwargs"]["img_size"] == 160


def test_exponent_numbers_in_a_config_file_and_model_kwargs_are_numbers(tmp_path):
    """``lr: 1e-3`` (and ``--model-kwargs drop_path_rate=1e-2``): PyYAML reads YAML 1.1, where a float needs a dot,
    so they were the strings ``'1e-3'`` and the run refused "lr must be a positive finite number, got '1e-3'".
    Quoted, a string stays a string."""
    from lambdanet.engine.config import config_source_from_args

    (tmp_path / "c.yaml").write_text("lr: 1e-3\nema_decay: 5E-4\nwarmup_epochs: 0\n")
    args = build_parser().parse_args(["train", "--config", str(tmp_path / "c.yaml"), "--model-kwargs",
                                      "drop_path_rate=1e-2", "--out", str(tmp_path / "r")])  # fmt: skip
    cfg = config_source_from_args(args, TrainConfig).resolve()
    assert (cfg.lr, cfg.ema_decay, cfg.drop_path_rate) == (0.001, 0.0005, 0.01)  # (the kwarg is the option)
    from lambdanet.engine.values import load_run_yaml, load_yaml, read_yaml, save_yaml

    assert read_yaml("a: '1e-3'\nb: 1e3x\nc: -2.5e+1") == {"a": "1e-3", "b": "1e3x", "c": -25.0}
    # a string that reads as such a number is written quoted: it reads back as the string, as a file or as a run's
    saved = resolve_config(overrides={"out": "1e-3"})
    save_yaml(saved, tmp_path / "config.yaml")
    assert load_yaml(tmp_path / "config.yaml")["out"] == load_run_yaml(tmp_path / "config.yaml")["out"] == "1e-3"


def test_a_flag_given_as_null_wins_over_the_recipe_and_the_config_file(tmp_path):
    """Precedence defaults < recipe < config < flags holds for ``null`` too: a flag given as null parsed to ``None``,
    every flag's "not given", so ``--ema-decay null`` left paper90's 0.9999 (and the file's 0.9) in place and
    ``--compact-width null`` ("the paper's width") kept the compact one."""
    from lambdanet.engine.config import config_source_from_args

    def resolved(*argv):
        args = build_parser().parse_args(["train", *argv, "--out", str(tmp_path / "o")])
        return config_source_from_args(args, TrainConfig).resolve()

    paper = resolved("--recipe", "paper90")
    assert (paper.ema_decay, paper.lr_batch_scale) == (0.9999, 256)  # what null overrides
    cfg = resolved("--recipe", "paper90", "--ema-decay", "none", "--lr-batch-scale", "null")
    assert (cfg.ema_decay, cfg.lr_batch_scale) == (None, None)
    assert resolved().model_kwargs["base_width"] == 16  # quick: compact
    cfg = resolved("--compact-width", "null")
    assert cfg.compact_width is None and "base_width" not in cfg.model_kwargs  # the paper's width
    (tmp_path / "c.yaml").write_text("ema_decay: 0.9\nimg_size: 32\nmax_train_batches: 3\n")
    assert (resolved("--config", str(tmp_path / "c.yaml")).ema_decay, resolved("--config", str(tmp_path / "c.yaml"))
            .max_train_batches) == (0.9, 3)  # fmt: skip
    cfg = resolved("--config", str(tmp_path / "c.yaml"), "--ema-decay", "null", "--img-size", "null",
                   "--max-train-batches", "null")  # fmt: skip
    assert (cfg.ema_decay, cfg.max_train_batches, cfg.img_size) == (None, None, 16)  # 16: the data's own size


def _resolved(tmp_path, command, config_cls, *argv):
    from lambdanet.engine.config import config_source_from_args

    args = build_parser().parse_args([*command, *argv, "--out", str(tmp_path / "o")])
    return config_source_from_args(args, config_cls).resolve()


def _written(tmp_path, cfg, name="run.yaml"):
    """``cfg`` as a run writes it (its config.yaml)."""
    cfg.save_yaml(tmp_path / name)
    return str(tmp_path / name)


# flags that change what a quick digits run's config.yaml implied: its model options (stem, base_width, img_size),
# its image size (the data's), the model's own dropout; and a mapping flag, which updates the file's key by key
DIM_K8 = "layer_kwargs={dim_k: 8}"


@pytest.mark.parametrize("given, flags, asked", [
    (DIM_K8, ["--img-size", "32", "--compact-width", "32"], None), (DIM_K8, ["--img-size", "96"], None),
    (DIM_K8, ["--compact-width", "8"], None), (DIM_K8, ["--data", "fashion-mnist"], None),
    (DIM_K8, ["--model", "resnet26"], None), ("{}", ["--model", "lambda_resnet26rpt_256"], None),
    (DIM_K8, ["--model-kwargs", "se=true"], ["--model-kwargs", "{layer_kwargs: {dim_k: 8}, se: true}"]),
    (DIM_K8, [], None)])
def test_a_runs_config_file_with_a_flag_is_the_run_asked_for_with_both(tmp_path, given, flags, asked):
    """``train --config RUN/config.yaml --img-size 32 --compact-width 32`` built the model at the file's 16 px and
    width 16 (the run had written the options they implied into model_kwargs, which then counted as given; a
    global-attention model refused the new size); ``--model resnet26`` kept lambda_resnet26's options and
    ``--model-kwargs se=true`` dropped the file's. The file plus a flag is the run asked for with the file's
    flags and that flag (``asked``: those flags merged, where the two are one flag)."""
    resolved = lambda *argv: _resolved(tmp_path, ["train"], TrainConfig, *argv)  # noqa: E731
    file = _written(tmp_path, resolved("--model-kwargs", given))
    got, want = resolved("--config", file, *flags), resolved(*(asked or ["--model-kwargs", given, *flags]))
    assert (got.model, got.model_kwargs, got.img_size, got.drop_rate) == (
        want.model, want.model_kwargs, want.img_size, want.drop_rate)  # fmt: skip
    if given == DIM_K8:
        assert got.model_kwargs["layer_kwargs"] == {"dim_k": 8}  # what the file gave stays
    if flags == ["--img-size", "32", "--compact-width", "32"]:  # the figures, independently of the resolution
        assert got.model_kwargs == {"layer_kwargs": {"dim_k": 8}, "stem": "cifar", "base_width": 32, "img_size": 32}


def test_values_a_file_gives_that_equal_nothing_implied_stay_given(tmp_path):
    """Only a value equal to what the file's own options imply follows a flag: a width or a stem written by hand
    stays (and an unchanged image size keeps the file's model options exactly)."""
    resolved = lambda *argv: _resolved(tmp_path, ["train"], TrainConfig, *argv)  # noqa: E731
    (tmp_path / "c.yaml").write_text("img_size: 96\ncompact_width: 16\nmodel_kwargs: {base_width: 24, stem: cifar}\n")
    cfg = resolved("--config", str(tmp_path / "c.yaml"), "--img-size", "128", "--compact-width", "32")
    assert cfg.model_kwargs == {"base_width": 24, "stem": "cifar", "img_size": 128}  # (96 px implies no cifar stem)
    (tmp_path / "d.yaml").write_text("img_size: 32\nmodel_kwargs: {img_size: 32, stem: cifar}\n")
    assert resolved("--config", str(tmp_path / "d.yaml"), "--img-size", "32").model_kwargs["stem"] == "cifar"
    assert "stem" not in resolved("--config", str(tmp_path / "d.yaml"), "--img-size", "96").model_kwargs


def test_a_config_file_with_another_checkpoint_fine_tunes_that_checkpoints_model(tmp_path, tiny_digits_run):
    """A scratch run's (or another fine-tune's) config.yaml with ``--checkpoint RUN`` built the file's architecture
    and size, not the checkpoint's (the weights then did not fit): the checkpoint's own, as without the file."""
    resolved = lambda *argv: _resolved(tmp_path, ["train"], TrainConfig, *argv)  # noqa: E731
    narrow = tmp_path / "narrow"
    train(resolve_config(overrides={**FAST, "epochs": 1, "max_train_batches": 1, "compact_width": 8,
                                    "img_size": 24, "out": str(narrow)}))  # fmt: skip
    for file, checkpoint in ((_written(tmp_path, resolved("--img-size", "96")), tiny_digits_run),
                             (_written(tmp_path, resolved("--checkpoint", str(tiny_digits_run))), narrow)):
        want = resolved("--checkpoint", str(checkpoint))
        got = resolved("--config", file, "--checkpoint", str(checkpoint))
        assert (got.model_kwargs, got.img_size) == (want.model_kwargs, want.img_size)
    assert (want.model_kwargs["base_width"], want.img_size) == (8, 24)  # the narrow run's, not the file's 16 px


def test_img_size_given_as_null_fine_tunes_at_the_datasets_size(tmp_path, tiny_digits_run):
    """``--img-size null`` ("null: the dataset's") with ``--checkpoint RUN`` took the run's size, as if not given."""
    resolved = lambda *argv: _resolved(tmp_path, ["train"], TrainConfig, *argv)  # noqa: E731
    run = ("--checkpoint", str(tiny_digits_run), "--data", "mnist5k")
    unset, null = resolved(*run), resolved(*run, "--img-size", "null")
    assert (unset.img_size, unset.model_kwargs["img_size"]) == (16, 16)  # the run's
    assert (null.img_size, null.model_kwargs["img_size"]) == (28, 28)  # mnist5k's 28 x 28
    assert null.model_kwargs["stem"] == unset.model_kwargs["stem"] == "cifar"  # still the checkpoint's architecture


def test_a_language_model_runs_file_with_another_model_drops_the_options_its_model_wrote(tmp_path):
    """An ``lm train`` run of lambda_lm_tiny writes its pinned defaults (short_conv, decay) into model_kwargs;
    with ``--model transformer_lm_tiny`` they were refused as the transformer's options. Options the user gave
    stay."""
    from lambdanet.tasks.lm.config import LMConfig

    resolved = lambda *argv: _resolved(tmp_path, ["lm", "train"], LMConfig, *argv)  # noqa: E731
    file = _written(tmp_path, resolved("--model", "lambda_lm_tiny"))
    assert resolved("--config", file, "--model", "transformer_lm_tiny").model_kwargs == {}
    file = _written(tmp_path, resolved("--model", "lambda_lm_tiny", "--model-kwargs", "r=32"), "r.yaml")
    got = resolved("--config", file, "--model", "plain_lambda_lm_tiny")
    assert got.model_kwargs == {"r": 32} == resolved("--model", "plain_lambda_lm_tiny", "--model-kwargs", "r=32")\
        .model_kwargs  # fmt: skip
    assert resolved("--config", file).model_kwargs == yaml.safe_load(open(file))["model_kwargs"]  # unchanged


@pytest.mark.parametrize("flags", [["--backbone", "halonet_h0"], ["--pretrained-backbone"], []])
def test_a_detection_runs_file_with_another_backbone_or_initialisation_is_the_run_asked_for(tmp_path, flags):
    """A quick ``detect`` run's config.yaml holds the compact width of its backbone and its glyph pre-training:
    with ``--backbone halonet_h0`` the width was refused as the new backbone's option, with
    ``--pretrained-backbone`` the pre-training was refused beside it."""
    from lambdanet.tasks.detection.config import DetectConfig

    resolved = lambda *argv: _resolved(tmp_path, ["detect"], DetectConfig, *argv)  # noqa: E731
    got, want = resolved("--config", _written(tmp_path, resolved()), *flags), resolved(*flags)
    assert (got.backbone_kwargs, got.pretrain_steps, got.pretrained_backbone) == (
        want.backbone_kwargs, want.pretrain_steps, want.pretrained_backbone)  # fmt: skip


def test_summaries_are_standard_json_with_null_for_what_was_not_measured(tmp_path):
    """COCO's AP of a size class without objects is NaN, which ``summary.json`` held as the bare token ``NaN``:
    Python reads it, standard JSON readers (jq, JavaScript, ...) refuse the file. It is ``null``."""
    import math

    from lambdanet.engine.logger import read_json, write_json

    def strict(token):
        raise ValueError(f"not standard JSON: {token}")

    write_json({"bbox_AP_large": math.nan, "runs": [math.inf, 0.5], "deep": {"x": -math.inf, "n": 3}}, tmp_path / "s")
    text = (tmp_path / "s").read_text()
    assert json.loads(text, parse_constant=strict) == read_json(tmp_path / "s") == {
        "bbox_AP_large": None, "runs": [None, 0.5], "deep": {"x": None, "n": 3}}  # fmt: skip


def test_a_fine_tuned_run_resumes_from_another_working_folder(tmp_path, monkeypatch):
    """``--checkpoint r1`` (and ``--pseudo-labels``, ``--data-dir``) given relative were saved relative in
    config.yaml: ``train --resume --out /abs/ft`` from another folder failed "checkpoint 'r1' does not exist".
    They are saved absolute, ``~`` expanded, as ``--data`` already was."""
    import shutil
    from pathlib import Path

    fixture = Path(__file__).resolve().parent / "fixtures" / "runs_v1" / "train_done"  # resnet26 on digits
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir(), elsewhere.mkdir()
    shutil.copytree(fixture, work / "r1")
    monkeypatch.chdir(work)
    tiny = ["--max-train-batches", "1", "--batch-size", "32", "--no-progress", "--no-tensorboard"]
    assert main(["train", "--checkpoint", "r1", "--epochs", "1", *tiny, "--out", "ft"]) == 0
    saved = yaml.safe_load((work / "ft" / "config.yaml").read_text())
    assert saved["checkpoint"] == str(work / "r1")
    monkeypatch.chdir(elsewhere)
    assert main(["train", "--resume", "--out", str(work / "ft"), "--epochs", "2", "--no-progress"]) == 0
    assert json.loads((work / "ft" / "summary.json").read_text())["epochs"] == 2
    # a relative path is made absolute; a ~ path stays as written: each machine (or user) resuming expands its own
    cfg = resolve_config(overrides={"data_dir": "d", "out": str(tmp_path / "o")})
    assert cfg.data_dir == str(elsewhere / "d")
    assert resolve_config(overrides={"data_dir": "~/d", "out": str(tmp_path / "o")}).data_dir == "~/d"


# ------------------------------------------------------------------------------------------------- resume


def test_resume_extends_the_schedule_and_refuses_other_changes(tmp_path, capsys):
    out = tmp_path / "run"
    train(resolve_config(overrides={**FAST, "out": str(out)}))
    capsys.readouterr()
    summary = train(resolve_config(overrides={"out": str(out), "resume": True, "epochs": 4, "progress": False}))
    log = capsys.readouterr().out
    assert summary["epochs"] == 4 and "extending the run from 2 to 4 epochs" in log
    rows = (out / "metrics.csv").read_text().strip().splitlines()
    assert len(rows) == 5  # header + 4 epochs, none repeated
    assert yaml.safe_load((out / "config.yaml").read_text())["epochs"] == 4  # the file says what ran
    # the schedule is the 4-epoch one (2 steps per epoch, 2 warm-up steps): after epoch 3 (6 steps) the cosine is at
    # 0.25 of the base rate, where the old 2-epoch schedule had long reached 0
    from lambdanet.engine.optim import lr_at

    assert lr_at(6, 8, 2) == pytest.approx(0.25) and lr_at(6, 4, 2) == 0.0
    assert float(rows[3].split(",")[1]) == pytest.approx(2e-3 * 0.25)
    # anything else that changes what is computed is refused, naming the flag
    proc = _cli("train", "--out", str(out), "--resume", "--lr", "0.5", "--no-progress")
    assert proc.returncode == 2 and "--lr 0.5 (the run has 0.002)" in proc.stderr and "Traceback" not in proc.stderr
    with pytest.raises(ValueError, match="--epochs 1 is fewer than the 4 epochs"):
        train(resolve_config(overrides={"out": str(out), "resume": True, "epochs": 1, "progress": False}))



def test_resume_of_another_commands_run_names_that_command_in_one_line(tmp_path, capsys):
    """``train --resume --out`` a language-model run listed 6 unknown options and the 55 valid ones; the run is named
    for what it is, with the command that continues it (and the same the other way round)."""
    lm, classify = tmp_path / "lm", tmp_path / "classify"
    for folder, config in ((lm, "model: lambda_lm_nano\nvocab_size: 256\n"), (classify, "model: resnet26\n")):
        folder.mkdir()
        (folder / "config.yaml").write_text(config)
        (folder / "last.pt").write_bytes(b"PK")  # never read: the configuration tells
    assert main(["train", "--resume", "--out", str(lm)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"lambdanet train: error: nothing to resume in {lm} for lambdanet train: it is a language-model run "
        f"(lambdanet lm train); continue it with lambdanet lm train --resume --out {lm}"
    )
    assert main(["lm", "train", "--resume", "--out", str(classify)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"it is an image-classification run (lambdanet train); continue it with lambdanet train "
                        f"--resume --out {classify}") and "\n" not in err  # fmt: skip
    # a detection run stopped in its backbone's pre-training has no last.pt (its checkpoint is pretrain.pt)
    detect = tmp_path / "detect"
    detect.mkdir()
    (detect / "config.yaml").write_text("backbone: resnet26\n")
    (detect / "pretrain.pt").write_bytes(b"PK")
    assert main(["train", "--resume", "--out", str(detect)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"it is a detection run (lambdanet detect); continue it with lambdanet detect --resume --out "
                        f"{detect}") and "\n" not in err  # fmt: skip


def test_sweep_reuses_only_runs_of_the_same_configuration(tmp_path, capsys):
    out = tmp_path / "sweep"
    common = ["sweep", "--lrs", "0.002", "--model", "resnet26", "--epochs", "1", "--max-train-batches", "2",
              "--batch-size", "32", "--no-progress", "--no-tensorboard", "--out", str(out)]
    assert main(common) == 0
    first = json.loads((out / "sweep.json").read_text())["rows"][0]
    capsys.readouterr()
    assert main(common) == 0  # the same sweep again: read back, not retrained
    assert "already done with this configuration" in capsys.readouterr().out
    assert json.loads((out / "sweep.json").read_text())["rows"][0] == first
    # the docs' next command into the same --out: another model configuration must not reuse the conv run
    assert main([*common, "--model-kwargs", "stage_layers=LLLL"]) == 2
    err = capsys.readouterr().err
    assert "holds a run with another configuration" in err and "--model-kwargs" in err


def test_a_sweep_resumes_a_run_whose_extension_was_cut_short_not_its_old_result(tmp_path, capsys, power_cut):
    """A finished sweep run extended (``train --resume --epochs 3``, as the README suggests) and cut short: its old
    ``summary.json`` went with its old weights, so the sweep at 3 epochs resumes it (it reported the 1-epoch
    figure as "already done")."""
    out = tmp_path / "sweep"
    common = ["sweep", "--lrs", "0.002", "--model", "resnet26", "--compact-width", "8", "--max-train-batches", "2",
              "--batch-size", "32", "--no-progress", "--no-tensorboard", "--out", str(out)]  # fmt: skip
    assert main([*common, "--epochs", "1"]) == 0
    run = out / "resnet26" / "lr_0.002"
    with power_cut(3), pytest.raises(RuntimeError, match="power cut"):  # epoch 3's first step, after epoch 2's save
        main(["train", "--out", str(run), "--resume", "--epochs", "3", "--no-progress"])
    assert not (run / "summary.json").exists() and load_checkpoint(run / "last.pt")["epoch"] == 2
    capsys.readouterr()
    assert main([*common, "--epochs", "3"]) == 0
    assert "already done" not in capsys.readouterr().out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["epochs"] == 3 and json.loads((out / "sweep.json").read_text())["rows"][0]["final_acc"] == (
        summary["final_acc"])  # fmt: skip


# ----------------------------------------------------------------------------------------------- the lock


def test_a_run_directory_is_used_by_one_process_at_a_time(tmp_path):
    out = tmp_path / "run"
    with RunDirLock(out):  # another holder (flock conflicts across open file descriptions, even in one process)
        with pytest.raises(RunDirBusyError, match=f"in use by another lambdanet process \\(pid {os.getpid()}\\)"):
            train(resolve_config(overrides={**FAST, "out": str(out)}))
    assert not (out / "config.yaml").exists() and not (out / "metrics.csv").exists()
    train(resolve_config(overrides={**FAST, "epochs": 1, "out": str(out)}))  # released: the run goes ahead


def test_second_resume_while_the_first_runs_is_refused(tmp_path):
    out = tmp_path / "run"
    log = tmp_path / "first.log"
    with open(log, "w") as f:
        first = subprocess.Popen([sys.executable, "-m", "lambdanet", "train", "--out", str(out), "--epochs", "500",
                                  "--max-train-batches", "2", "--batch-size", "32", "--no-progress",
                                  "--no-tensorboard"], stdout=f, stderr=subprocess.STDOUT, env=ENV)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and first.poll() is None and not (out / "last.pt").exists():
            time.sleep(0.05)
        assert first.poll() is None and (out / "last.pt").exists(), log.read_text()[-2000:]
        second = _cli("train", "--out", str(out), "--resume", "--no-progress")
        assert second.returncode == 2, second.stderr
        assert f"in use by another lambdanet process (pid {first.pid})" in second.stderr
        assert "Traceback" not in second.stderr
    finally:
        first.kill()
        first.wait()
    epochs = [int(row.split(",")[0]) for row in (out / "metrics.csv").read_text().strip().splitlines()[1:]]
    assert epochs == list(range(1, len(epochs) + 1))  # one writer: each epoch once, in order


# ------------------------------------------------------------------------------------------ offline data


def _no_network(*args, **kwargs):
    raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")


@pytest.mark.parametrize("name", ["fashion-mnist", "cifar10", "cifar100"])
def test_datasets_that_cannot_be_had_offline_give_one_line(tmp_path, monkeypatch, name):
    import torchvision.datasets.cifar as tv_cifar
    import torchvision.datasets.mnist as tv_mnist

    monkeypatch.setattr(D, "FASHION_MNIST_DIR", tmp_path / "no-debian-package")
    monkeypatch.setattr(tv_mnist, "download_and_extract_archive", _no_network)
    monkeypatch.setattr(tv_cifar, "download_and_extract_archive", _no_network)
    data_dir = tmp_path / "data"
    with pytest.raises(D.DatasetUnavailableError) as err:
        D.build_datasets(name, data_dir=data_dir, download=False)
    msg = str(err.value)
    assert "\n" not in msg and name in msg and str(data_dir) in msg and "--no-download was given" in msg
    assert "download=True" not in msg  # not torchvision's advice, which the user cannot act on
    if name == "fashion-mnist":
        assert "dataset-fashion-mnist" in msg and "no-debian-package" in msg
    with pytest.raises(D.DatasetUnavailableError) as err:
        D.build_datasets(name, data_dir=data_dir, download=True)
    msg = str(err.value)
    assert "\n" not in msg and "the download failed (" in msg and "name resolution" in msg, msg


def test_eval_on_another_dataset_takes_download_or_no_download(tmp_path, monkeypatch, capsys, tiny_digits_run):
    """``eval --data cifar10`` reused the run's ``download`` setting with no flag to change it: a run trained
    offline said "--no-download was given" and refused ``--download``; one trained with downloads on downloaded
    170 MB with no way to say no."""
    import torchvision.datasets.cifar as tv_cifar

    monkeypatch.setattr(tv_cifar, "download_and_extract_archive", _no_network)
    base = ["eval", "--checkpoint", str(tiny_digits_run), "--data", "cifar10", "--data-dir", str(tmp_path)]
    assert main([*base, "--no-download"]) == 2
    assert "--no-download was given" in capsys.readouterr().err
    assert main([*base, "--download"]) == 2  # tried (the network is off here), as asked
    assert "the download failed (" in capsys.readouterr().err


def test_a_damaged_dataset_copy_is_not_called_missing(tmp_path):
    """A cifar-10-batches-py whose files fail torchvision's checksums was reported "not found ... and
    --no-download was given"; the folder is there: it says so, and what to do."""
    folder = tmp_path / "data" / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    for name in ("data_batch_1", "test_batch", "batches.meta"):
        (folder / name).write_bytes(b"not a pickle")
    with pytest.raises(D.DatasetUnavailableError) as err:
        D.build_datasets("cifar10", data_dir=tmp_path / "data", download=False)
    msg = str(err.value)
    assert msg.startswith(f"dataset cifar10: {folder} is there but incomplete or damaged") and "\n" not in msg
    assert "--download" in msg and "not found" not in msg and "download=True" not in msg


def test_cli_offline_dataset_error_has_no_traceback(tmp_path):
    proc = _cli("train", "--data", "cifar10", "--no-download", "--data-dir", str(tmp_path), "--out",
                str(tmp_path / "run"), "--no-progress")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lambdanet train: error: dataset cifar10 was not found in")


# -------------------------------------------------------------------------------------------- bad files


def test_eval_of_a_file_that_is_not_a_checkpoint_says_what_it_is(tmp_path, capsys):
    out = tmp_path / "run"
    train(resolve_config(overrides={**FAST, "epochs": 1, "out": str(out)}))
    capsys.readouterr()
    for name, what in [("config.yaml", "is a text file (YAML"), ("summary.json", "is a text file (JSON"),
                       ("model.safetensors", "is a safetensors weights file")]:
        assert main(["eval", "--checkpoint", str(out / name)]) == 2
        err = capsys.readouterr().err
        assert what in err and "not a training checkpoint" in err and "weights_only" not in err, err
    with pytest.raises(CheckpointError, match="an empty file"):
        (tmp_path / "empty.pt").write_bytes(b"")
        load_checkpoint(tmp_path / "empty.pt")
    damaged = r"is corrupted or truncated and cannot be loaded \(it is an empty file\); delete it or restore a copy$"
    with pytest.raises(CheckpointError, match=damaged):  # a copy cut short: not a file of another kind
        load_checkpoint(tmp_path / "empty.pt")


def test_a_checkpoint_of_zeros_or_of_binary_bytes_is_not_called_a_text_file(tmp_path):
    """A ``last.pt`` whose bytes became zeros (a filesystem's crash, a copy cut short) was "a text file, not a
    training checkpoint; pass the last.pt that lambdanet train writes" (NUL bytes decode as UTF-8), and torch
    names it a file of its legacy tar format: it is damaged. Other bytes holding NULs (a tar archive) are binary."""
    import tarfile

    path = tmp_path / "last.pt"
    path.write_bytes(bytes(4096))
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(path)
    assert str(caught.value) == (f"checkpoint {path} is corrupted or truncated and cannot be loaded (its first bytes "
                                 "are zeros); delete it or restore a copy")  # fmt: skip
    (tmp_path / "a.txt").write_text("not a checkpoint")
    with tarfile.open(path, "w") as archive:
        archive.add(tmp_path / "a.txt", arcname="a.txt")
    with pytest.raises(CheckpointError, match=r"is not a torch checkpoint \(neither a zip archive nor a pickle\)"):
        load_checkpoint(path)


# ------------------------------------------------------------------------------------------------- help


def test_every_train_option_has_a_description_and_its_choices(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    import dataclasses

    for f in dataclasses.fields(TrainConfig):
        assert f.metadata["help"].split("(")[0].strip()[:30] in text, f.name
    for flag, choices in [("--amp", "{none,bf16,fp16}"), ("--optimizer", "{sgd,adam,adamw,rmsprop}"),
                          ("--schedule", "{cosine,constant,step}"),
                          ("--recipe", "{quick,paper90,paper350,cifar_repro}")]:
        assert f"{flag} {choices}" in text, flag


def test_a_mistyped_flag_shows_the_commands_usage(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--epocs", "3"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "usage: lambdanet train" in err and "unrecognized arguments: --epocs 3" in err


def test_top_level_help_says_what_lambdanet_is_and_demo_is_documented():
    text = build_parser().format_help()
    assert "LambdaNetworks" in text and "demo" in text
    demo = build_parser().commands["demo"].format_help()
    for flag in ("--dim", "--dim-k", "--heads", "--r", "--size", "--batch"):
        line = next(row for row in demo.splitlines() if row.strip().startswith(flag + " "))
        assert len(line.split()) > 2, line  # a description after the flag and its metavar


def test_models_paper_honours_the_pattern(capsys):
    assert main(["models", "--paper", "--no-flops", "lambda_resnet1*"]) == 0
    rows = list(capsys.readouterr().out.splitlines()[2:])
    from lambdanet.models.paper_tables import PAPER_ROWS

    expected = [r for r in PAPER_ROWS if r.model and r.model.startswith("lambda_resnet1")]
    assert len(rows) == len(expected) >= 4 and all("lambda_resnet1" in row for row in rows)


def test_one_epoch_inside_the_warmup_is_flagged(tmp_path, capsys):
    train(resolve_config(overrides={**FAST, "epochs": 1, "out": str(tmp_path / "run")}))
    log = capsys.readouterr().out
    assert "warning: --epochs 1 ends inside the 1-epoch learning-rate warm-up" in log
    assert "warning" not in capsys.readouterr().out
    train(resolve_config(overrides={**FAST, "epochs": 2, "out": str(tmp_path / "run2")}))
    assert "warm-up" not in capsys.readouterr().out


# ----------------------------------------------------------------------------- offline hub (issue 40, item 5)


@pytest.fixture
def no_network(monkeypatch, tmp_path):
    """No route to any host (a socket connection fails at once, as without DNS), an empty weights cache, and a
    stand-in for huggingface_hub's download that records each call: offline, only its cache answers (empty)."""
    import socket

    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    calls = {"connect": 0, "download": [], "sleep": []}

    def connect(*args, **kwargs):
        calls["connect"] += 1
        raise OSError("[Errno -2] Name or service not known")

    def download(repo_id, filename, revision=None, local_files_only=False, **kwargs):
        calls["download"].append("cache" if local_files_only else "network")
        if local_files_only:
            raise LocalEntryNotFoundError("not in the cache")
        time.sleep(3)  # what huggingface_hub's retries of a failing connection stand for (~25 s)
        raise OSError("An error happened while trying to locate the file on the Hub")

    monkeypatch.setattr(socket, "create_connection", connect)
    # a wait (the stand-in's retries below, or a back-off of the caller's own) is recorded, not slept: "fail at once"
    # is then a count, not a wall-clock reading that a busy CI machine could exceed
    monkeypatch.setattr(time, "sleep", lambda seconds: calls["sleep"].append(seconds))
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    monkeypatch.setenv("LAMBDANET_CACHE", str(tmp_path / "weights"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    for proxy in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(proxy, raising=False)
    return calls


@pytest.mark.parametrize("offline_env", [False, True])
def test_pretrained_weights_offline_fail_at_once_on_one_line(no_network, monkeypatch, offline_env, tmp_path,
                                                            capsys):
    from PIL import Image

    from lambdanet.models import create_model
    from lambdanet.models.pretrained import PretrainedUnavailableError

    if offline_env:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(PretrainedUnavailableError) as err:
        create_model("lambda_resnet26t", pretrained=True)
    assert no_network["sleep"] == []  # no download attempted: no retries to wait for
    msg = str(err.value)
    assert "\n" not in msg and "offline (" in msg and "checkpoint_path=FILE" in msg, msg
    assert ("HF_HUB_OFFLINE is set" if offline_env else "huggingface.co cannot be reached") in msg, msg
    assert no_network["download"] == ["cache"]  # huggingface_hub's cache asked, the network never
    assert no_network["connect"] == (0 if offline_env else 1)  # one quick try, none when told offline
    Image.new("RGB", (8, 8)).save(tmp_path / "img.png")
    assert main(["predict", str(tmp_path / "img.png"), "--model", "lambda_resnet26t", "--pretrained"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_hub_models_offline_fail_at_once_and_pushing_offline_is_one_line(no_network, monkeypatch, tmp_path, capsys):
    import huggingface_hub

    from lambdanet.models import create_model

    with pytest.raises(ValueError, match="offline \\(huggingface.co cannot be reached"):
        create_model("hf-hub:someone/model")
    assert no_network["download"] == ["cache"] and no_network["sleep"] == []  # at once: nothing waited for

    class OfflineApi:  # huggingface_hub's client when the connection fails (an httpx error, not an OSError)
        def __init__(self, token=None):
            pass

        def create_repo(self, *args, **kwargs):
            raise RuntimeError("[Errno -2] Name or service not known")

    monkeypatch.setattr(huggingface_hub, "HfApi", OfflineApi)
    run = tmp_path / "run"
    train(resolve_config(overrides={**FAST, "epochs": 1, "out": str(run)}))
    capsys.readouterr()
    assert main(["push-to-hub", str(run), "someone/digits"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot upload to someone/digits: offline (" in err and "--folder" in err, err


# ------------------------------------------------------------------------- whole sentences (issue 40, item 5)


def test_error_reason_keeps_whole_sentences():
    from lambdanet.files import error_reason

    first = "Reading failed: no central directory."
    second = "This is an internal error."
    long = f"{first} {second} If you see this error, there is a high likelihood that the file is damaged " * 3
    assert error_reason(RuntimeError(long), 80) == f"{first} {second}"
    assert error_reason(RuntimeError(long), 50) == first
    assert error_reason(RuntimeError("short\nsecond line"), 80) == "short"
    word = error_reason(RuntimeError("a" * 10 + " b" * 100), 40)  # one sentence too long: whole words, then ...
    assert word.endswith("...") and len(word) <= 40 and not word.removesuffix("...").endswith(" ")
    assert error_reason(KeyError()) == "KeyError"


def test_corrupted_checkpoint_message_ends_at_a_sentence(tmp_path, capsys):
    import re

    import torch

    good = tmp_path / "good.pt"
    torch.save({"model": {"w": torch.zeros(1000)}}, good)
    bad = tmp_path / "run" / "last.pt"
    bad.parent.mkdir()
    bad.write_bytes(good.read_bytes()[:3000])
    with pytest.raises(Exception) as torch_err:  # torch's own words for the damage
        torch.load(bad, weights_only=True)
    torchs = str(torch_err.value).strip().splitlines()[0]
    assert main(["eval", "--checkpoint", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is corrupted or truncated" in err and err.rstrip().endswith("restore a copy")
    reason = re.search(rf"\({type(torch_err.value).__name__}: (.*)\); delete it", err).group(1)
    sentences = re.split(r"(?<=[.!?]) ", torchs)
    assert reason in [" ".join(sentences[:k]) for k in range(1, len(sentences) + 1)], (reason, torchs)


# ----------------------------------------------------------------------------------- docs (issue 40, item 6)


def test_language_models_doc_snippet_runs_verbatim():
    """The first Python block of docs/language_models.md, run as it is written."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "language_models.md").read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    exec(compile(code, "docs/language_models.md", "exec"), namespace)
    prompt, out = namespace["prompt"], namespace["out"]
    assert out.shape == (1, prompt.shape[1] + 200) and out[0, : prompt.shape[1]].tolist() == list(b"def main(")
