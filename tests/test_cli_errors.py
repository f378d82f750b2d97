"""User errors in the command line (the error-handling audit, section A): each is one line on stderr that names
the option or configuration key and what it must be, exit status 2, no traceback, and nothing is trained or
written first. Every case runs the real entry point, ``lambdanet.cli.main``."""

import dataclasses
import shutil
import sys
import typing
from pathlib import Path

import pytest
import torch

from lambdanet.cli import main

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "runs_v1"
# a run that would start: as small as a run gets (each case here fails before any of it)
TINY = ["--data", "digits", "--epochs", "1", "--max-train-batches", "1", "--batch-size", "8", "--no-tensorboard",
        "--no-progress", "--threads", "1"]
LM_TINY = ["--model", "lambda_lm_nano", "--epochs", "1", "--steps-per-epoch", "1", "--batch-size", "2",
           "--context", "16", "--no-tensorboard", "--no-progress", "--threads", "1"]
DETECT_TINY = ["--pretrain-steps", "0", "--epochs", "1", "--max-train-batches", "1", "--img-size", "64",
               "--procs", "1", "--no-tensorboard", "--no-progress", "--threads", "1"]


def error_line(capsys, argv) -> str:
    """``lambdanet ARGV`` exits with status 2 and one line on stderr (no traceback); that line."""
    assert main(argv) == 2, argv
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


def usage_error(capsys, argv) -> str:
    """argparse's usage error (the usage, then one ``error:`` line naming the argument, exit status 2); that
    line."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return err.strip().splitlines()[-1]


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# ------------------------------------------------------------------------- A1: values in a YAML configuration
@pytest.mark.parametrize("text, needle", [
    ("lr: abc\n", "lr must be a positive finite number, got 'abc'"),
    ("warmup_epochs: abc\n", "warmup_epochs must be a finite number >= 0, got 'abc'"),
    ('label_smoothing: "0.1"\n', "label_smoothing must be a finite number in [0, 1), got '0.1'"),
    ("data: 5\n", "data must be a string, got 5"),
    ("momentum: abc\noptimizer: sgd\n", "momentum must be a finite number in [0, 1), got 'abc'"),
    ("betas: 0.9\n", "betas must be a list, got 0.9"),
    ("augment: maybe\n", "augment must be true or false, got 'maybe'"),
    ("model_kwargs: stage_layers=CCLL\n", "model_kwargs must be a mapping (key: value), got 'stage_layers=CCLL'"),
    ("lr: [1\n", "is not valid YAML (line 2, column 1: expected ',' or ']'"),
    ("- lr\n", "must hold a mapping of option: value, got list"),
])
def test_a_bad_value_in_a_config_file_is_one_line_naming_the_key(tmp_path, capsys, text, needle):
    config = write(tmp_path / "c.yaml", text)
    err = error_line(capsys, ["train", *TINY, "--config", str(config), "--out", str(tmp_path / "run")])
    assert needle in err
    assert not (tmp_path / "run").exists()


def numeric_fields(config_cls) -> list[str]:
    hints = typing.get_type_hints(config_cls)
    return [f.name for f in dataclasses.fields(config_cls)
            if {int, float} & {hints[f.name], *typing.get_args(hints[f.name])}]


def _classes():
    from lambdanet.tasks.classification.config import TrainConfig
    from lambdanet.tasks.detection.config import DetectConfig
    from lambdanet.tasks.lm.config import LMConfig

    return {"train": TrainConfig, "lm train": LMConfig, "detect": DetectConfig}


# the values that keep a run tiny, unless the key under test is one of them
SMALL = {"epochs": 1, "max_train_batches": 1, "batch_size": 8, "steps_per_epoch": 1, "pretrain_steps": 0,
         "procs": 1, "tensorboard": False, "progress": False}


@pytest.mark.parametrize("command, key", [(c, k) for c, cls in _classes().items() for k in numeric_fields(cls)])
def test_every_numeric_option_of_every_task_is_type_checked(tmp_path, capsys, command, key):
    """Each number of each task's configuration (a --config file, a run's config.yaml) is checked by type with
    its range: a string is one line naming the key, never a comparison's TypeError."""
    fields = {f.name for f in dataclasses.fields(_classes()[command])}
    values = {k: v for k, v in SMALL.items() if k in fields and k != key}
    text = "".join(f"{k}: {str(v).lower()}\n" for k, v in values.items()) + f"{key}: abc\n"
    config = write(tmp_path / "c.yaml", text)
    err = error_line(capsys, [*command.split(), "--config", str(config), "--out", str(tmp_path / "run")])
    assert f"error: {key} must be " in err and err.endswith("got 'abc'"), err


@pytest.mark.parametrize("text, needle", [
    ("lr_steps: 0.5\n", "lr_steps must be a list, got 0.5"),
    ("lr_steps: [0.5, abc]\n", "lr_steps must be increasing fractions in (0, 1), got [0.5, 'abc']"),
    ("detector: foo\n", "detector must be a mapping (key: value), got 'foo'"),
    ("jitter_min: abc\n", "jitter_min must be a positive finite number (a scale of img_size), got 'abc'"),
    ("loss_weights: {loss_mask: .nan}\n", "loss_weights must map loss names"),
    ("lr: [1\n", "is not valid YAML (line 2, column 1"),
])
def test_detect_config_file_values_are_checked(tmp_path, capsys, text, needle):
    config = write(tmp_path / "d.yaml", text)
    assert needle in error_line(capsys, ["detect", *DETECT_TINY, "--config", str(config), "--out",
                                         str(tmp_path / "run")])


@pytest.mark.parametrize("text, needle", [
    ("lr: [1\n", "config.yaml is not valid YAML (line 2, column 1"),
    ("lr: abc\n", "lr must be a positive finite number, got 'abc'"),
    ("", "config.yaml is empty, so the run cannot be resumed"),  # A5
    ("# truncated\n", "config.yaml is empty, so the run cannot be resumed"),
])
def test_resume_with_a_damaged_config_yaml_is_refused_and_nothing_changes(tmp_path, capsys, text, needle):
    """A5: a run's config.yaml emptied, truncated or broken: --resume refuses it (instead of continuing under
    the defaults) and leaves the run as it was."""
    run = shutil.copytree(FIXTURES / "train", tmp_path / "run")
    (run / "config.yaml").write_text(text)
    before = (run / "last.pt").read_bytes()
    err = error_line(capsys, ["train", "--resume", "--epochs", "2", "--no-progress", "--out", str(run)])
    assert needle in err and str(run / "config.yaml") in err
    assert (run / "last.pt").read_bytes() == before and (run / "config.yaml").read_text() == text


def test_the_config_yaml_is_written_whole_or_not_at_all(tmp_path):
    """A5's cause: config.yaml is written beside and renamed over the old one, never truncated in place."""
    from lambdanet.engine.config import load_yaml
    from lambdanet.tasks.classification.config import TrainConfig

    path = tmp_path / "config.yaml"
    path.write_text("old: 1\n")
    TrainConfig(epochs=3).save_yaml(path)
    assert load_yaml(path)["epochs"] == 3 and [p.name for p in tmp_path.iterdir()] == ["config.yaml"]


# ----------------------------------------------------------------------------------------- A2: --betas
@pytest.mark.parametrize("command", [["train", *TINY], ["lm", "train", *LM_TINY], ["sweep", "--lrs", "0.1", *TINY]])
@pytest.mark.parametrize("betas", [["0.9"], ["0.9", "0.9", "0.9"], ["0.9", "1.0"]])
def test_betas_must_be_two_numbers_in_0_1(tmp_path, capsys, command, betas):
    err = error_line(capsys, [*command, "--betas", *betas, "--out", str(tmp_path / "run")])
    assert "betas must be two numbers in [0, 1) (Adam's beta1 beta2), got [" in err


# -------------------------------------------------------------------- A3 / A4: mapping options, --detector
@pytest.mark.parametrize("argv, needle", [
    (["train", *TINY, "--model-kwargs", "{a: [1"],
     "argument --model-kwargs: expected a mapping like 'key=value,...' or '{key: value}', got '{a: [1'"),
    (["train", *TINY, "--model-kwargs", "stage_layers=CCLL,base_width"], "(each item key=value)"),
    (["detect", *DETECT_TINY, "--detector", "anchor_sizes=[16,32"], "argument --detector: expected a mapping"),
    (["detect", *DETECT_TINY, "--loss-weights", "3"], "argument --loss-weights: expected a mapping"),
])
def test_a_malformed_mapping_option_is_argparse_usage_error(tmp_path, capsys, argv, needle):
    assert needle in usage_error(capsys, [*argv, "--out", str(tmp_path / "run")])


def test_mapping_options_take_lists_in_the_key_value_form():
    from lambdanet.engine.config import _parse_mapping

    assert _parse_mapping("anchor_sizes=[8, 16,32,64,128],fpn_channels=16") == {
        "anchor_sizes": [8, 16, 32, 64, 128], "fpn_channels": 16}
    assert _parse_mapping("stage_layers=CCLL,layer_kwargs={r: 7, h: 2}") == {
        "stage_layers": "CCLL", "layer_kwargs": {"r": 7, "h": 2}}
    # Python's None as YAML's null (the error used to say "must be one of None, ..., got 'None'")
    assert _parse_mapping("decay=None,short_conv=4,key_norm=none") == {"decay": None, "short_conv": 4,
                                                                        "key_norm": "none"}
    assert _parse_mapping("{decay: None, key_norm: none}") == {"decay": None, "key_norm": "none"}


@pytest.mark.parametrize("detector, needle", [
    ("foo=1", "detector does not take ['foo']; valid keys: fpn_channels, anchor_sizes"),
    ("anchor_sizes=[1,2]", "DetectorOptions.anchor_sizes must be 5 positive sizes, one per level P2..P6, got (1, 2)"),
    ("anchor_sizes=[a,b,c,d,e]", "DetectorOptions.anchor_sizes must be 5 positive sizes"),
    ("box_score_thresh=high", "DetectorOptions.box_score_thresh must be in [0, 1], got 'high'"),
])
def test_detector_options_are_checked_before_anything_runs(tmp_path, capsys, detector, needle):
    assert needle in error_line(capsys, ["detect", *DETECT_TINY, "--detector", detector, "--out",
                                         str(tmp_path / "run")])
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------------- A6: where output goes
@pytest.fixture
def spots(tmp_path):
    """A folder, a file and a path under that file."""
    (tmp_path / "adir").mkdir()
    (tmp_path / "notes.txt").write_text("mine")
    return tmp_path / "adir", tmp_path / "notes.txt", tmp_path / "notes.txt" / "x"


@pytest.mark.parametrize("command", [
    ["export", "--checkpoint", str(FIXTURES / "train_done"), "--format", "torchscript", "--out"],
    ["pseudo-label", "--checkpoint", str(FIXTURES / "train"), "--out"],
])
def test_an_output_file_that_is_a_folder_or_under_a_file_is_refused_first(spots, capsys, command):
    folder, file, under = spots
    assert f"--out {folder} is a directory; give a file path" in error_line(capsys, [*command, str(folder)])
    err = error_line(capsys, [*command, str(under / "k.pt")])
    assert f"--out {under / 'k.pt'}: {file} is a file, not a directory" in err
    assert file.read_text() == "mine" and not any(folder.iterdir())


@pytest.mark.parametrize("command, option", [
    (["bench", "table4", "--out"], "--out"),
    (["push-to-hub", str(FIXTURES / "train_done"), "someone/digits", "--folder"], "--folder"),
])
def test_an_output_folder_that_is_a_file_is_refused_first(spots, capsys, command, option):
    _, file, under = spots
    assert f"{option} {file} is a file, not a directory" in error_line(capsys, [*command, str(file)])
    assert f"{option} {under}: {file} is a file, not a directory" in error_line(capsys, [*command, str(under)])
    assert file.read_text() == "mine"


# ----------------------------------------------------------------------------------- A7 / A8: bench, demo
@pytest.mark.parametrize("option", ["--repeats", "--img-size", "--batch-size"])
@pytest.mark.parametrize("value", ["0", "-3"])
def test_bench_sizes_must_be_positive_also_with_quick(tmp_path, capsys, option, value):
    err = error_line(capsys, ["bench", "models", "--quick", option, value, "--out", str(tmp_path / "b")])
    assert f"{option} must be a positive int, got {value}" in err
    assert not (tmp_path / "b").exists()


def test_run_benchmarks_checks_its_sizes(tmp_path):
    from lambdanet.bench.runner import run_benchmarks

    with pytest.raises(ValueError, match="^repeats must be a positive int, got 0$"):
        run_benchmarks(["table4"], quick=True, repeats=0, out=tmp_path / "b", log=lambda _: None)
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("option", ["--size", "--batch"])
@pytest.mark.parametrize("value", ["0", "-2"])
def test_demo_sizes_must_be_positive(capsys, option, value):
    other = {"--size": ["--batch", "1"], "--batch": ["--size", "4"]}[option]
    assert f"{option} must be a positive int, got {value}" in error_line(capsys, ["demo", option, value, *other])


# -------------------------------------------------------------------------------------- A9: pseudo-labels
def test_pseudo_label_takes_the_teachers_run_directory(tmp_path, capsys):
    """The run directory stands for its last.pt (this teacher saw every label, which is the next error)."""
    err = error_line(capsys, ["pseudo-label", "--checkpoint", str(FIXTURES / "train"), "--out", str(tmp_path / "p.pt")])
    assert "was trained on all labels (labeled_fraction=1.0)" in err and "does not exist" not in err


def test_sweep_refuses_a_single_lr_flag_it_would_ignore(tmp_path, capsys):
    """``sweep --lr`` was dropped in silence (every run trains at one of ``--lrs``)."""
    err = error_line(capsys, ["sweep", "--lrs", "0.1", *TINY, "--lr", "0.2", "--out", str(tmp_path / "s")])
    assert "--lr 0.2 does not apply to sweep, which trains once per rate of --lrs" in err
    assert not (tmp_path / "s").exists()


def test_a_teacher_whose_fraction_leaves_no_unlabelled_image_says_so(tmp_path, capsys):
    """--labeled-fraction 0.9997 of digits' 1,438 training images rounds to all of them labelled: said in one line
    (it was torch's "torch.cat(): expected a non-empty list of Tensors")."""
    teacher = tmp_path / "teacher"
    assert main(["train", "--data", "digits", "--model", "resnet26", "--compact-width", "8", "--epochs", "1",
                 "--max-train-batches", "1", "--labeled-fraction", "0.9997", "--no-progress", "--no-tensorboard",
                 "--out", str(teacher)]) == 0  # fmt: skip
    capsys.readouterr()
    err = error_line(capsys, ["pseudo-label", "--checkpoint", str(teacher), "--out", str(tmp_path / "p.pt")])
    assert "labeled_fraction=0.9997 of 1438 images: every one is labelled, none left to pseudo-label" in err
    assert not (tmp_path / "p.pt").exists()


def test_a_training_checkpoint_that_is_a_folder_says_so(tmp_path):
    from lambdanet.engine.checkpoint import CheckpointError, load_checkpoint

    with pytest.raises(CheckpointError, match="is a directory; pass the training checkpoint in it"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("threshold", ["5", "-1", "nan", "inf"])
def test_pseudo_label_threshold_must_be_in_0_1(tmp_path, capsys, threshold):
    err = error_line(capsys, ["pseudo-label", "--checkpoint", str(FIXTURES / "train"), "--out",
                              str(tmp_path / "p.pt"), "--threshold", threshold])
    assert "--threshold must be" in err and "in [0, 1] (a softmax confidence), got" in err
    assert not (tmp_path / "p.pt").exists()


@pytest.mark.parametrize("content, needle", [
    (b"", "is empty or corrupt (EOFError"),
    (b"PK\x03\x04 truncated", "is empty or corrupt"),
    (None, "holds no pseudo-labels (no indices and labels)"),
])
def test_a_damaged_pseudo_label_file_is_one_line(tmp_path, capsys, content, needle):
    path = tmp_path / "pl.pt"
    if content is None:
        torch.save([1, 2, 3], path)
    else:
        path.write_bytes(content)
    err = error_line(capsys, ["train", *TINY, "--labeled-fraction", "0.5", "--pseudo-labels", str(path), "--out",
                              str(tmp_path / "run")])
    assert f"pseudo_labels file {path} {needle}" in err and "lambdanet pseudo-label" in err


# ----------------------------------------------------------------------------- A10: ranges of the options
@pytest.mark.parametrize("args, needle", [
    (["--weight-decay", "-1"], "weight_decay must be >= 0, got -1.0"),
    (["--warmup-start-factor", "-1"], "warmup_start_factor must be in [0, 1] (a fraction of lr), got -1.0"),
    (["--warmup-start-factor", "1.5"], "warmup_start_factor must be in [0, 1]"),
    (["--min-lr", "-1"], "min_lr must be in [0, 0.002]"),
    (["--min-lr", "0.01"], "min_lr must be in [0, 0.002] (at most the learning rate the schedule starts from)"),
    (["--lr", "0.1", "--lr-batch-scale", "256", "--min-lr", "0.01"], "min_lr must be in [0, 0.003125]"),
    (["--schedule", "step", "--lr-decay-rate", "-1"], "lr_decay_rate must be in (0, 1] (the step schedule's factor)"),
    (["--lr-decay-rate", "0"], "lr_decay_rate must be in (0, 1]"),
    (["--lr-decay-rate", "1.5"], "lr_decay_rate must be in (0, 1]"),
    (["--bn-momentum", "-1"], "bn_momentum must be in (0, 1) (1 - TF's decay) or null, got -1.0"),
    (["--bn-momentum", "2"], "bn_momentum must be in (0, 1)"),
    (["--bn-momentum", "0"], "bn_momentum must be in (0, 1)"),
    (["--ema-decay", "1"], "ema_decay must be in (0, 1) or null, got 1.0"),
    (["--drop-rate", "1"], "drop_rate must be in [0, 1) or null, got 1.0"),
    (["--drop-path-rate", "-0.1"], "drop_path_rate must be in [0, 1) or null"),
    (["--randaugment-magnitude", "99"], "randaugment_magnitude must be at most 31"),
    (["--randaugment-magnitude", "32"], "randaugment_magnitude must be at most 31"),
    (["--lr", "inf"], "lr must be a positive finite number, got inf"),
    (["--lr", "nan"], "lr must be a positive finite number, got nan"),
    (["--lr", "0"], "lr must be positive, got 0.0"),
    (["--momentum", "-1"], "momentum must be in [0, 1), got -1.0"),
    (["--momentum", "1"], "momentum must be in [0, 1), got 1.0"),
    (["--seed", "-1"], "seed must be a non-negative int below 2**32, got -1"),
    (["--seed", str(2**32)], f"seed must be a non-negative int below 2**32, got {2**32}"),
    (["--labeled-fraction", "0"], "labeled_fraction must be in (0, 1], got 0.0"),
    (["--val-split", "nan"], "val_split must be a finite number in [0, 1), got nan"),
])
def test_train_options_out_of_range_are_one_line_before_anything_runs(tmp_path, capsys, args, needle):
    assert needle in error_line(capsys, ["train", *TINY, *args, "--out", str(tmp_path / "run")])
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("args, needle", [
    (["--warmup-steps", "-1"], "warmup_steps must be a non-negative int, got -1"),
    (["--grad-clip", "-1"], "grad_clip must be >= 0 (0: no clipping) or null, got -1.0"),
    (["--grad-clip", "inf"], "grad_clip must be a finite number >= 0"),
    (["--min-lr", "1"], "min_lr must be in [0, 0.003] (the cosine schedule's floor, at most lr), got 1.0"),
    (["--eval-bytes", "1"], "eval_bytes must be an int >= 2 (null: all) or null, got 1"),
    (["--lr-batch-scale", "0"], "lr_batch_scale must be a positive int (a batch size) or null, got 0"),
    (["--weight-decay", "-0.1"], "weight_decay must be >= 0"),
    (["--seed", "-1"], "seed must be a non-negative int below 2**32"),
    (["--model-kwargs", "vocab_size=300"], "model_kwargs must not set vocab_size: use --vocab-size"),
])
def test_lm_train_options_out_of_range_are_one_line(tmp_path, capsys, args, needle):
    assert needle in error_line(capsys, ["lm", "train", *LM_TINY, *args, "--out", str(tmp_path / "run")])


@pytest.mark.parametrize("args, needle", [
    (["--grad-clip", "-1"], "grad_clip must be >= 0 (0: no clipping) or null, got -1.0"),
    (["--max-eval-images", "0"], "max_eval_images must be a positive int (test images evaluated) or null, got 0"),
    (["--warmup-steps", "-1"], "warmup_steps must be a non-negative int, got -1"),
    (["--jitter-min", "0"], "jitter_min must be positive (a scale of img_size), got 0.0"),
    (["--lr-steps", "0.5", "1.5"], "lr_steps must be increasing fractions in (0, 1), got [0.5, 1.5]"),
    (["--momentum", "1", "--optimizer", "sgd"], "momentum must be in [0, 1)"),
    (["--workers", "-1"], "workers must be a non-negative int, got -1"),
    (["--max-train-batches", "0"], "max_train_batches must be a positive int (batches per epoch) or null, got 0"),
    (["--no-masks", "--loss-weights", "loss_mask=2"], "loss_weights sets loss_mask, which --no-masks (Faster R-CNN)"),
    (["--backbone-kwargs", "num_classes=5,features_only=false"],
     "backbone_kwargs must not set ['features_only', 'num_classes']: the detector and the backbone's pre-training"),
    (["--backbone-kwargs", "min_size=64"], "backbone_kwargs must not set ['min_size']"),
    (["--seed", "-1"], "seed must be a non-negative int below 2**32"),
    # no full batch: every epoch was empty (a KeyError, then --resume reported the untrained run finished)
    (["--batch-size", "512"], "batch_size=512 is larger than the 500 training images of glyphs; lower --batch-size"),
])
def test_detect_options_out_of_range_are_one_line(tmp_path, capsys, args, needle):
    assert needle in error_line(capsys, ["detect", *DETECT_TINY, *args, "--out", str(tmp_path / "run")])


def test_the_edges_of_the_ranges_are_valid():
    """What the ranges keep: a grad_clip of 0 (no clipping, as optimizer_step treats it), HaloNet H7's
    RandAugment magnitude 31, a warm-up from 0 or at full rate, no step decay, min_lr = lr."""
    from lambdanet.tasks.classification.config import resolve_config
    from lambdanet.tasks.lm.config import LMConfig

    cfg = resolve_config(overrides={"randaugment_magnitude": 31, "warmup_start_factor": 1.0, "lr_decay_rate": 1.0,
                                    "min_lr": 2e-3, "seed": 2**32 - 1, "bn_momentum": 0.5, "momentum": 0.0})
    assert (cfg.randaugment_magnitude, cfg.seed) == (31, 2**32 - 1)
    assert resolve_config(overrides={"warmup_start_factor": 0.0}).warmup_start_factor == 0.0
    assert LMConfig.resolve(overrides={"grad_clip": 0.0, "min_lr": LMConfig.lr}).grad_clip == 0.0
    assert LMConfig.resolve(overrides={"grad_clip": None}).grad_clip is None


# ---------------------------------------------------------------------------------- A11: fp16 on a CPU
@pytest.mark.parametrize("command", [["train", *TINY], ["lm", "train", *LM_TINY], ["detect", *DETECT_TINY]])
def test_fp16_on_a_cpu_is_one_line_without_torchs_warning(tmp_path, capsys, command):
    err = error_line(capsys, [*command, "--amp", "fp16", "--device", "cpu", "--out", str(tmp_path / "run")])
    assert err.endswith("amp='fp16' needs device='cuda', got device='cpu'; use amp='bf16' on CPU")


# ------------------------------------------------------------------------ A12: train --checkpoint FILE
@pytest.mark.parametrize("content, needle", [
    (b"", "is an empty file"),
    (bytes(range(7, 200)), "is not a torch checkpoint or safetensors file"),
    (b"\xff\xd8\xff\xe0 JFIF", "is not a torch checkpoint or safetensors file"),
])
def test_train_checkpoint_that_is_no_weights_file_is_one_short_line(tmp_path, capsys, content, needle):
    path = write(tmp_path / "weights.bin", "")
    path.write_bytes(content)
    err = error_line(capsys, ["train", *TINY, "--checkpoint", str(path), "--out", str(tmp_path / "run")])
    assert f"checkpoint '{path}' {needle} (expected a run directory of lambdanet train" in err
    assert len(err) < 300


def test_create_model_checkpoint_path_that_is_no_weights_file_is_one_line(tmp_path):
    from lambdanet.files import WeightsMismatchError, read_state_dict

    path = tmp_path / "w.pth"
    for content, needle in ((b"", "is an empty file"), (b"\x9b\x00 random", "is not a torch checkpoint"),
                            (bytes(64), r"is a damaged file \(its first bytes are zeros")):
        path.write_bytes(content)
        with pytest.raises(WeightsMismatchError, match=needle) as err:
            read_state_dict(path)
        assert "\n" not in str(err.value)


# -------------------------------------------------------------------------- A13: --config, --out paths
def test_config_that_is_a_folder_or_binary_names_the_file(tmp_path, capsys):
    argv = ["train", *TINY, "--out", str(tmp_path / "run"), "--config"]
    assert f"config file {tmp_path} is a directory, not a YAML file" in error_line(capsys, [*argv, str(tmp_path)])
    binary = tmp_path / "c.bin"
    binary.write_bytes(bytes([0x9B, 0xFF, 0x00, 0x80]) * 8)
    assert f"config file {binary} is not a text file (not UTF-8)" in error_line(capsys, [*argv, str(binary)])
    missing = tmp_path / "none.yaml"
    assert f"config file {missing} does not exist" in error_line(capsys, [*argv, str(missing)])


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_an_out_folder_that_cannot_be_made_names_out(capsys):
    err = error_line(capsys, ["train", *TINY, "--out", "/proc/lambdanet-none/run"])
    assert "--out /proc/lambdanet-none/run cannot be used as a run directory" in err and "choose another --out" in err


# --------------------------------------------------------------------------------------------- A14: export
def test_export_img_size_zero_is_refused(tmp_path, capsys):
    err = error_line(capsys, ["export", "--checkpoint", str(FIXTURES / "train_done"), "--format", "torchscript",
                              "--img-size", "0", "--out", str(tmp_path / "m.pt")])
    assert "--img-size must be a positive int, got 0" in err and not (tmp_path / "m.pt").exists()


def test_export_of_a_language_model_says_so(tmp_path, capsys):
    err = error_line(capsys, ["export", "--model", "lambda_lm_nano", "--format", "torchscript", "--out",
                              str(tmp_path / "m.pt")])
    assert "lambda_lm_nano is a language model; lambdanet export takes image models" in err


# --------------------------------------------------------------------------------------- A15: lm sample
def test_lm_sample_takes_the_prompts_bytes_and_prints_on_any_terminal(capsys, monkeypatch):
    """Bytes that are not UTF-8 on the command line reach Python as lone surrogates ('\\xff' -> '\\udcff'): they
    were refused ("--prompt must be valid UTF-8 text"), so a model of Latin-1 text could not be prompted in its own
    bytes; they are the prompt's bytes, as the API takes them. A terminal or pipe of another encoding (latin-1,
    ascii) failed after sampling ("codec can't encode"): what it cannot show is "?"."""
    import io

    from lambdanet.tasks.lm.task import sample

    run = str(Path(__file__).resolve().parent / "fixtures" / "lm_runs_fixed" / "lm_done")
    want = sample(run, b"ab\xff", max_new_tokens=4, top_k=1)
    assert main(["lm", "sample", "--checkpoint", run, "--prompt", "ab\udcff", "--max-new-tokens", "4",
                 "--top-k", "1"]) == 0  # fmt: skip
    assert capsys.readouterr().out == want.decode("utf-8", errors="replace") + "\n"
    latin = io.TextIOWrapper(io.BytesIO(), encoding="latin-1")
    monkeypatch.setattr(sys, "stdout", latin)
    assert main(["lm", "sample", "--checkpoint", run, "--prompt", "ab\udcff", "--max-new-tokens", "4",
                 "--top-k", "1"]) == 0  # fmt: skip
    latin.flush()
    text = want.decode("utf-8", errors="replace").encode("latin-1", errors="replace") + b"\n"
    assert latin.buffer.getvalue() == text and text.startswith(b"ab?")


def test_lm_sample_of_learnt_positions_says_how_many_tokens_fit(tmp_path, capsys):
    """A model of learnt positions (``positions=learned, max_len=32``) failed every ``lm sample`` with its defaults
    ("the sequence is 258 tokens long but the model takes at most max_len=32"): the line says how many new tokens
    fit after the prompt (or how long a prompt may be), in the command's flags; that many are sampled."""
    from lambdanet.tasks.lm.task import sample

    (tmp_path / "c.txt").write_bytes(b"abcdefgh \n" * 400)
    run = str(tmp_path / "tl")
    assert main(["lm", "train", "--data", f"text:{tmp_path / 'c.txt'}", "--model", "transformer_lm_nano",
                 "--model-kwargs", "positions=learned,max_len=32", "--context", "32", "--epochs", "1",
                 "--steps-per-epoch", "1", "--eval-bytes", "512", "--no-progress", "--no-tensorboard",
                 "--out", run]) == 0  # fmt: skip
    capsys.readouterr()
    err = error_line(capsys, ["lm", "sample", "--checkpoint", run, "--prompt", "abc"])
    assert err.endswith("--prompt of 3 bytes and --max-new-tokens 256 need 258 positions, but the model has learnt "
                        "32 (max_len, learnt positions): at most --max-new-tokens 30 after this --prompt")
    err = error_line(capsys, ["lm", "sample", "--checkpoint", run, "--prompt", "a" * 40, "--max-new-tokens", "0"])
    assert err.endswith("shorten --prompt to at most 32 bytes")
    assert len(sample(run, b"abc", max_new_tokens=30)) == 33  # the most that fits is sampled
    with pytest.raises(ValueError, match="at most max_new_tokens=30 after this prompt$"):
        sample(run, b"abc", max_new_tokens=31)


def test_lm_sample_reads_a_prompt_file_or_stdin(tmp_path, capsys, monkeypatch):
    """A prompt above the command line's limit (128 KiB on Linux), or one with trailing newlines (``$(cat f)`` drops
    them), had no way in: ``--prompt-file PATH`` (``-``: standard input) gives the file's bytes, as the API takes
    them."""
    import io

    from lambdanet.tasks.lm.task import sample

    run = str(Path(__file__).resolve().parent / "fixtures" / "lm_runs_fixed" / "lm_done")
    (tmp_path / "p.txt").write_bytes(b"def f():\n\n")
    want = sample(run, b"def f():\n\n", max_new_tokens=3, top_k=1).decode("utf-8", errors="replace") + "\n"
    tail = ["--max-new-tokens", "3", "--top-k", "1"]
    assert main(["lm", "sample", "--checkpoint", run, "--prompt-file", str(tmp_path / "p.txt"), *tail]) == 0
    assert capsys.readouterr().out == want
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"def f():\n\n")))
    assert main(["lm", "sample", "--checkpoint", run, "--prompt-file", "-", *tail]) == 0
    assert capsys.readouterr().out == want
    err = error_line(capsys, ["lm", "sample", "--checkpoint", run, "--prompt-file", str(tmp_path / "none.txt")])
    assert f"--prompt-file {tmp_path / 'none.txt'}: cannot be read (No such file or directory)" in err
    with pytest.raises(SystemExit) as stop:  # argparse's own usage error
        main(["lm", "sample", "--checkpoint", run, "--prompt", "a", "--prompt-file", "-"])
    assert stop.value.code == 2
    assert "argument --prompt-file: not allowed with argument --prompt" in capsys.readouterr().err


@pytest.mark.parametrize("args, needle", [
    (["--max-new-tokens", "-1"], "--max-new-tokens must be a non-negative int, got -1"),
    (["--top-k", "0"], "--top-k must be a positive int (1: greedy), got 0"),
    (["--temperature", "0"], "--temperature must be > 0 and finite, got 0.0 (greedy: --top-k 1)"),
    (["--temperature", "nan"], "--temperature must be > 0 and finite, got nan (greedy: --top-k 1)"),
])
def test_lm_sample_errors_name_the_flags(tmp_path, capsys, args, needle):
    """They named the API's arguments (``top_k must be a positive int or None``: None cannot be typed)."""
    err = error_line(capsys, ["lm", "sample", "--checkpoint", str(tmp_path), "--prompt", "ab", *args])
    assert err.endswith(needle)


def test_the_python_api_still_takes_a_path_object_for_out_and_refuses_a_number_for_data(tmp_path):
    """The type checks accept what the Python API always took (``out=Path(...)``, a path-like for a string option)
    and refuse what no option can be (a number for ``data``)."""
    from lambdanet.tasks.classification import resolve_config

    cfg = resolve_config(overrides={"data": "digits", "out": tmp_path / "run", "epochs": 1})
    assert Path(cfg.out) == tmp_path / "run"
    with pytest.raises(ValueError, match=r"^data must be a string, got 5$"):
        resolve_config(overrides={"data": 5, "out": str(tmp_path / "x")})


def test_a_checkpoint_of_another_task_away_from_its_run_is_named_by_every_image_command(tmp_path, capsys):
    """A ``last.pt`` copied out of its run folder has no ``config.yaml`` beside it: the commands that take an image
    classifier's checkpoint read its task from the checkpoint's own configuration and refuse it in one line (eval
    raised a TypeError, predict and export named the corpus as an unknown dataset). In a run folder the message also
    says what to do with the run (a detection run's ``summary.json``: where it is, or will be once it ends)."""
    import numpy as np
    from PIL import Image

    fixtures = Path(__file__).parent / "fixtures"
    lm, det = tmp_path / "lm.pt", tmp_path / "det" / "last.pt"
    det.parent.mkdir()
    shutil.copy(fixtures / "lm_runs_fixed" / "lm" / "last.pt", lm)
    shutil.copy(fixtures / "runs_v1" / "detect" / "last.pt", det)
    image = tmp_path / "x.png"
    Image.fromarray(np.zeros((8, 8), dtype=np.uint8), mode="L").save(image)
    lm_says = (f"{lm} is from a language-model run (lambdanet lm train), not an image-classification run "
               "(lambdanet train)")
    for argv in (["eval", "--checkpoint", str(lm)], ["predict", str(image), "--checkpoint", str(lm)],
                 ["export", "--checkpoint", str(lm), "--format", "torchscript", "--out", str(tmp_path / "m.pt")],
                 ["pseudo-label", "--checkpoint", str(lm), "--out", str(tmp_path / "p.pt")]):
        assert main(argv) == 2
        assert capsys.readouterr().err == (f"lambdanet {argv[0]}: error: {lm_says}; continue a prompt with lambdanet "
                                           f"lm sample --checkpoint {lm}\n")  # the file: it loads  # fmt: skip
    assert main(["eval", "--checkpoint", str(det.parent)]) == 2  # the folder: its last.pt, read
    assert capsys.readouterr().err == (f"lambdanet eval: error: {det} is from a detection run (lambdanet detect), not "
                                       "an image-classification run (lambdanet train); its box AP (and mask AP) are "
                                       "in the summary.json of the run that wrote it\n")  # fmt: skip
    run = tmp_path / "detect_run"  # the run folder itself, unfinished: no summary.json yet
    shutil.copytree(fixtures / "runs_v1" / "detect", run)
    assert main(["eval", "--checkpoint", str(run)]) == 2
    assert capsys.readouterr().err.endswith(f"; its box AP (and mask AP) will be in {run}/summary.json when it ends "
                                            f"(lambdanet detect --resume --out {run} continues it)\n")  # fmt: skip
    (run / "summary.json").write_text("{}")
    assert main(["eval", "--checkpoint", str(run)]) == 2
    assert capsys.readouterr().err.endswith(f"; its box AP (and mask AP) are in {run}/summary.json\n")
    assert main(["eval", "--checkpoint", str(tmp_path)]) == 2  # a folder without last.pt: no weights-file advice
    assert capsys.readouterr().err.endswith("holds no training checkpoint (last.pt); pass a run directory of "
                                            "lambdanet train or its last.pt\n")  # fmt: skip
    assert main(["eval", "--checkpoint", ""]) == 2
    assert "the checkpoint path is empty" in capsys.readouterr().err


# ------------------------------------------------------------------- A16: found by the bad-input fuzz of the CLI
LM_RUN = Path(__file__).resolve().parent / "fixtures" / "lm_runs_fixed" / "lm_done"


@pytest.mark.parametrize("command", [["train", *TINY], ["sweep", "--lrs", "0.1", *TINY]])
@pytest.mark.parametrize("run, kind", [(LM_RUN, "a language-model run (lambdanet lm train)"),
                                       (FIXTURES / "detect", "a detection run (lambdanet detect)")])
def test_fine_tuning_from_another_tasks_run_is_one_line(tmp_path, capsys, command, run, kind):
    """``--checkpoint`` of a language-model run raised a KeyError ('image_size', its header has none) and a
    detection run listed 176 missing keys; both are named as the run they are, and nothing is written."""
    err = error_line(capsys, [*command, "--checkpoint", str(run), "--out", str(tmp_path / "out")])
    assert f"{run} is {kind}, not an image-classification run (lambdanet train)" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, needle", [
    (["train", *TINY, "--out", ""], "--out is empty; give a folder for the run"),
    (["lm", "train", *LM_TINY, "--out", ""], "--out is empty; give a folder for the run"),
    (["detect", *DETECT_TINY, "--out", ""], "--out is empty; give a folder for the run"),
    (["sweep", "--lrs", "0.1", *TINY, "--out", ""], "--out is empty; give a folder for the run"),
    (["bench", "table4", "--quick", "--out", ""], "--out is empty; give the folder of the results"),
    (["push-to-hub", str(FIXTURES / "train_done"), "someone/digits", "--folder", ""], "--folder is empty; give "),
    (["pseudo-label", "--checkpoint", str(FIXTURES / "train"), "--out", ""], "--out is empty; give a file path"),
    (["export", "--checkpoint", str(FIXTURES / "train_done"), "--format", "torchscript", "--out", ""],
     "--out is empty; give a file path"),
    (["train", *TINY, "--config", "", "--out", "run"], "the config file path is empty; give a YAML file"),
    (["train", *TINY, "--pseudo-labels", "", "--out", "run"], "pseudo_labels is empty; give the file lambdanet "),
    (["predict", "", "--checkpoint", str(FIXTURES / "train_done")], "an image path is empty; give image files"),
    (["eval", "--checkpoint", str(FIXTURES / "train_done"), "--data-dir", ""], "--data-dir is empty; give a "),
    (["lm", "sample", "--checkpoint", "", "--prompt", "ab"], "the checkpoint path is empty; pass a run directory "),
])
def test_an_empty_path_is_refused_not_taken_for_the_working_folder(tmp_path, monkeypatch, capsys, argv, needle):
    """``Path('')`` is the working folder: ``--out ''`` wrote a run (or the benchmark results) there, an empty
    ``--folder`` uploaded to the hub instead, an empty ``--config`` or ``--pseudo-labels`` was dropped and an empty
    IMAGE classified the working folder's images. Each is one line now, and the working folder stays as it was."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.png").write_bytes(b"")  # what an empty IMAGE found in the working folder
    assert needle in error_line(capsys, argv)
    assert [p.name for p in tmp_path.iterdir()] == ["x.png"]


def test_predict_and_export_name_an_empty_checkpoint(tmp_path, capsys):
    image = tmp_path / "x.png"
    image.write_bytes(b"")
    for argv in (["predict", str(image), "--checkpoint", ""],
                 ["export", "--checkpoint", "", "--format", "torchscript", "--out", str(tmp_path / "m.pt")]):
        assert "the checkpoint path is empty; pass a run directory" in error_line(capsys, argv)  # not ". is a folder"
    assert [p.name for p in tmp_path.iterdir()] == ["x.png"]


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
@pytest.mark.parametrize("command, path", [
    (["export", "--checkpoint", str(FIXTURES / "train_done"), "--format", "torchscript", "--out"], "x.pt"),
    (["pseudo-label", "--checkpoint", str(FIXTURES / "train"), "--out"], "x.pt"),
    (["push-to-hub", str(FIXTURES / "train_done"), "someone/digits", "--folder"], "repo"),
])
def test_an_output_where_nothing_can_be_written_names_the_option_first(capsys, command, path):
    """An output under a folder that cannot be made (/proc takes none) was a bare ``[Errno 2] No such file or
    directory: '/proc/lambdanet-none'``, for pseudo-label once its work was done; the output's place is tried
    first."""
    option, path = command[-1], f"/proc/lambdanet-none/{path}"
    err = error_line(capsys, [*command, path])
    assert f"{option} {path}: cannot write there (" in err and f"; choose another {option}" in err


@pytest.mark.parametrize("argv, needle", [
    (["bogus"], "unknown bench part(s) ['bogus']; valid: targets"),
    (["scaling", "--layers", "bogus"], "--layers: unknown bench layer(s) ['bogus']"),
    # --layers takes every word after it: the part it swallowed is named, and where parts go
    (["--layers", "lambda", "scaling"], "['scaling']; valid: global_attention"),
    (["--layers", "lambda", "scaling"], "(scaling: a part; put the parts before --layers / --suites)"),
    (["table4", "--amp", "fp16"], "amp='fp16' needs device='cuda', got device='cpu'"),
])
def test_bench_checks_its_parts_before_making_out(tmp_path, capsys, argv, needle):
    assert needle in error_line(capsys, ["bench", *argv, "--quick", "--out", str(tmp_path / "b")])
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("argv", [
    ["sweep", "--lrs", "0.1", *TINY, "--model", "lambda_lm_nano"],
    ["sweep", "--lrs", "0.1", *TINY, "--labeled-fraction", "0.5", "--pseudo-labels", "none.pt"],
    ["train", *TINY, "--batch-size", "4096"],
])
def test_a_run_that_fails_before_its_first_file_leaves_no_folders(tmp_path, capsys, argv):
    """The run folder's lock made ``--out`` with its missing parents and removed only ``--out`` on an error before
    the first file: a sweep left ``--out/<model>`` (and ``--out``), a nested ``--out`` its parents."""
    out = tmp_path / "a" / "b" / "out"
    error_line(capsys, [*argv, "--out", str(out)])
    assert list(tmp_path.iterdir()) == []


def test_pseudo_labels_that_are_a_folder_say_so(tmp_path, capsys):
    err = error_line(capsys, ["train", *TINY, "--labeled-fraction", "0.5", "--pseudo-labels", str(tmp_path), "--out",
                              str(tmp_path / "run")])
    assert err.endswith(f"pseudo_labels file {tmp_path} is a directory")  # not "does not exist"


def test_threads_beyond_a_c_int_names_threads(capsys):
    err = error_line(capsys, ["eval", "--checkpoint", str(FIXTURES / "train_done"), "--threads", str(2**63)])
    assert err.endswith(f"--threads must be a positive int below 2**31 (CPU threads), got {2**63}")


@pytest.mark.parametrize("argv, option", [
    (["train", *TINY, "--img-size", str(2**63)], "img_size"),
    (["train", *TINY, "--compact-width", str(2**63)], "compact_width"),
    (["lm", "train", *LM_TINY, "--vocab-size", str(2**63)], "vocab_size"),
    (["lm", "train", *LM_TINY, "--steps-per-epoch", str(2**64)], "steps_per_epoch"),
    (["lm", "train", *LM_TINY, "--batch-size", str(-(2**63) - 1)], "batch_size"),
])
def test_an_int_option_past_64_bits_is_named(tmp_path, capsys, argv, option):
    """An int option past torch's 64-bit integers ended in torch's TypeError ("Overflow when unpacking long long")
    where it first became a size; every int of a run's configuration is checked to fit first."""
    err = error_line(capsys, [*argv, "--out", str(tmp_path / "run")])
    assert f"{option} must be a 64-bit int (below 2**63" in err and not (tmp_path / "run").exists()


@pytest.mark.parametrize("argv", [
    ["train", *TINY, "--img-size", str(2**62)],
    ["lm", "train", *LM_TINY, "--vocab-size", str(2**40)],
])
def test_sizes_no_memory_holds_say_so_in_one_line(tmp_path, capsys, argv):
    """Sizes within 64 bits that no memory holds (a tensor past 2**63 bytes, or the allocator's refusal) end in one
    line that says the memory ran out and what to lower, exit status 1; the traceback was torch's RuntimeError."""
    assert main([*argv, "--out", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error: out of memory (" in err and "lower the sizes asked" in err, err
