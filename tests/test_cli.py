"""The command-line interface, run in-process through ``lambdanet.cli.main``."""

import shutil
from pathlib import Path

import pytest
import torch

from lambdanet.cli import main


def test_models_lists_params_flops_and_input_size(capsys):
    assert main(["models", "resnet_rs50*"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "| model | params (M) | GFLOPs | input size |"
    rows = {line.split("|")[1].strip(): line for line in out[2:]}
    assert set(rows) == {"resnet_rs50", "resnet_rs50_se"}
    cells = [c.strip() for c in rows["resnet_rs50"].split("|")[1:-1]]
    assert float(cells[1]) == pytest.approx(25.6, abs=0.1) and float(cells[2]) > 4 and cells[3] == "160"


def test_models_unknown_pattern_fails(capsys):
    assert main(["models", "nothing*", "--no-flops"]) == 1
    assert "no registered model matches" in capsys.readouterr().err


def test_models_pretrained_builds_only_the_published_and_refuses_paper(capsys, monkeypatch):
    """``--pretrained`` lists the models with published weights and builds only those (every model takes
    minutes); with ``--paper`` (tables without weights) it is a one-line error instead of being ignored."""
    from lambdanet.models import summary
    from lambdanet.models.registry import published_models

    built = []
    real = summary.model_summary
    monkeypatch.setattr(summary, "model_summary", lambda name, **kw: built.append(name) or real(name, **kw))
    assert main(["models", "--pretrained", "--no-flops"]) == 0
    listed = {line.split("|")[1].strip() for line in capsys.readouterr().out.splitlines()[2:]}
    assert listed == set(built) == set(published_models())
    assert main(["models", "--paper", "A2", "--no-flops"]) == 1  # the table is 'HaloNet A2': the tables are listed
    err = capsys.readouterr().err
    assert err.startswith("lambdanet models: no paper-table row") and "'13'" in err and "'HaloNet A2'" in err
    assert main(["models", "--paper", "--pretrained", "--no-flops"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--paper lists the papers' tables" in err and "--pretrained" in err


def test_demo_runs(capsys, monkeypatch):
    """The implementation it names is the one its timed forward ran (the tuner's measured pick, not the static
    plan it printed before), timed after the untimed call that measures them."""
    from lambdanet.ops.position_lambda import tuning

    ran = []
    choice = tuning.auto_choice
    monkeypatch.setattr(tuning, "auto_choice", lambda layer, x, **kw: ran.append(choice(layer, x, **kw)) or ran[-1])
    assert main(["demo", "--dim", "32", "--size", "8", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "input (2, 32, 8, 8) -> output (2, 32, 8, 8)" in out
    assert f"(impl={ran[0]}, after one untimed call)" in out


def test_demo_errors_name_the_flags(capsys):
    """The layer's own message names its arguments; the demo adds the flags that gave them, and refuses one
    position (BatchNorm's "Expected more than 1 value per channel") naming --batch and --size."""
    assert main(["demo", "--dim", "10", "--heads", "4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "heads=4 must divide dim_out=10" in err and "--dim 10" in err and "--heads 4" in err
    assert main(["demo", "--size", "1", "--batch", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--batch 1 with --size 1 is one position" in err
    assert main(["demo", "--size", "1", "--batch", "2", "--dim", "16", "--heads", "2"]) == 0


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "usage: lambdanet" in capsys.readouterr().out


# ------------------------------------------------------------- what a new user hit in the CLI (issue 40, 4-6)
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "runs_v1"


def one_line_error(capsys, argv) -> str:
    """``lambdanet ARGV`` exits with status 2 and one line on stderr (no traceback); that line."""
    assert main(argv) == 2, argv
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):
    """A byte-level language-model run (lambdanet lm train), one optimiser step."""
    from lambdanet.tasks.lm.task import LMConfig, train_lm

    root = tmp_path_factory.mktemp("lm_run")
    (root / "corpus").mkdir()
    for i in range(3):
        (root / "corpus" / f"f{i}.txt").write_text("def add(a, b):\n    return a + b\n" * 30)
    cfg = LMConfig.resolve(overrides={"data": f"text:{root / 'corpus'}", "model": "lambda_lm_nano", "context": 16,
                                      "epochs": 1, "steps_per_epoch": 1, "batch_size": 2, "warmup_steps": 1,
                                      "out": str(root / "run"), "tensorboard": False, "progress": False})
    train_lm(cfg, log=lambda _: None)
    return root / "run"


@pytest.fixture(scope="module")
def detect_run(tmp_path_factory):
    """A detection run (lambdanet detect; its config.yaml and last.pt) with the model.safetensors a finished run
    writes (the detector's weights, the header naming its backbone), and that weights file alone elsewhere."""
    from lambdanet.engine.checkpoint import export_safetensors

    root = tmp_path_factory.mktemp("detect_run")
    run = shutil.copytree(FIXTURES / "detect", root / "run")
    export_safetensors(torch.nn.Linear(2, 2), run / "model.safetensors", {"backbone": "resnet26"})
    (root / "loose").mkdir()
    shutil.copy(run / "model.safetensors", root / "loose" / "model.safetensors")
    return run


@pytest.fixture(scope="module")
def grey_image(tmp_path_factory):
    from PIL import Image

    path = tmp_path_factory.mktemp("img") / "grey.png"
    Image.new("L", (8, 8), 128).save(path)
    return path


@pytest.mark.parametrize("command", ["predict", "export", "eval", "pseudo-label"])
@pytest.mark.parametrize("kind", ["lm", "detect"])
def test_image_commands_given_another_tasks_run_say_what_it_is(command, kind, lm_run, detect_run, grey_image,
                                                               tmp_path, capsys):
    runs = {"lm": [lm_run, lm_run / "model.safetensors", lm_run / "last.pt"],
            "detect": [detect_run, detect_run / "last.pt", detect_run.parent / "loose" / "model.safetensors"]}
    what = {"lm": "a language-model run (lambdanet lm train)", "detect": "a detection run (lambdanet detect)"}
    for path in runs[kind]:
        argv = {"predict": ["predict", str(grey_image), "--checkpoint", str(path)],
                "export": ["export", "--checkpoint", str(path), "--format", "torchscript", "--out",
                           str(tmp_path / "m.pt")],
                "eval": ["eval", "--checkpoint", str(path)],
                "pseudo-label": ["pseudo-label", "--checkpoint", str(path), "--out", str(tmp_path / "p.pt")]}
        if command == "pseudo-label" and path.suffix == ".safetensors":
            continue  # it takes a last.pt
        err = one_line_error(capsys, argv[command])
        assert what[kind] in err and "not an image-classification run (lambdanet train)" in err, err
        assert "older lambdanet" not in err
        assert ("lambdanet lm sample" if kind == "lm" else "summary.json") in err, err


@pytest.mark.parametrize("kind", ["classify", "detect"])
def test_lm_sample_given_another_tasks_run_says_what_it_is(kind, tiny_digits_run, detect_run, capsys):
    run = tiny_digits_run if kind == "classify" else detect_run
    err = one_line_error(capsys, ["lm", "sample", "--checkpoint", str(run), "--prompt", "x"])
    assert err.startswith(f"lambdanet lm sample: error: {run} is a")
    assert "not a language-model run (lambdanet lm train)" in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_a_gpu_is_one_line(tiny_digits_run, lm_run, grey_image, capsys):
    for argv in (["eval", "--checkpoint", str(tiny_digits_run), "--device", "cuda"],
                 ["lm", "sample", "--checkpoint", str(lm_run), "--prompt", "x", "--device", "cuda"],
                 ["predict", str(grey_image), "--checkpoint", str(tiny_digits_run), "--device", "cuda"]):
        assert "--device cuda but no CUDA device is available; use --device cpu" in one_line_error(capsys, argv)


@pytest.mark.parametrize("batch", ["-1", "0"])
def test_eval_batch_size_must_be_positive(batch, tiny_digits_run, capsys):
    err = one_line_error(capsys, ["eval", "--checkpoint", str(tiny_digits_run), "--batch-size", batch])
    assert f"--batch-size must be a positive int, got {batch}" in err


@pytest.mark.parametrize("command", [["train"], ["lm", "train"], ["detect", "--procs", "2"], ["sweep", "--lrs", "0.1"]])
def test_out_that_is_a_file_is_one_line_and_the_file_is_kept(command, tmp_path, capsys):
    file = tmp_path / "notes.txt"
    file.write_text("mine")
    err = one_line_error(capsys, [*command, "--out", str(file), "--no-progress"])
    assert f"--out {file} is a file, not a directory" in err
    err = one_line_error(capsys, [*command, "--out", str(file / "run"), "--no-progress"])
    assert f"--out {file / 'run'}: {file} is a file, not a directory" in err
    assert file.read_text() == "mine"


def test_unknown_model_names_the_close_ones_on_one_short_line(grey_image, capsys):
    from lambdanet.models import list_models

    err = one_line_error(capsys, ["predict", str(grey_image), "--model", "lambda_resnet26x", "--pretrained"])
    assert "unknown model 'lambda_resnet26x'; did you mean lambda_resnet26," in err, err
    assert f"lists all {len(list_models())}" in err
    assert len(err) < 200 and "botnet26t_256" not in err  # not every registered name
    err = one_line_error(capsys, ["export", "--model", "zzzz", "--format", "torchscript"])
    assert "unknown model 'zzzz'; no registered name is close to it" in err and len(err) < 200


@pytest.mark.parametrize("argv", [["train", "--epochs", "1"], ["lm", "train"], ["detect", "--procs", "1"],
                                  ["eval"], ["predict"], ["lm", "sample"], ["export"]])
def test_threads_runs_the_command_with_that_many_threads_and_restores_them(argv, monkeypatch, tiny_digits_run,
                                                                           lm_run, grey_image, tmp_path, capsys):
    """``--threads N``: the library call behind each command runs with N intra-op threads, the count before
    comes back afterwards, and 0 is a one-line error."""
    import lambdanet.tasks.lm.task as lm_task
    import lambdanet.predict as predict_module
    import lambdanet.tasks.classification.task as trainer

    before = torch.get_num_threads()
    want = 1 if before != 1 else 2
    seen = []

    def record(result):
        def fn(*args, **kwargs):
            seen.append(torch.get_num_threads())
            return result
        return fn

    res = {"model": "m", "weights": "ema", "epoch": 1, "data": "digits", "split": "test", "top1": 1.0, "top5": 1.0,
           "loss": 0.0, "samples": 1}
    monkeypatch.setattr(trainer, "train", record({}))
    monkeypatch.setattr(trainer, "evaluate_checkpoint", record(res))
    monkeypatch.setattr(lm_task, "train_lm", record({}))
    monkeypatch.setattr(lm_task, "sample", record(b"x"))
    monkeypatch.setattr(predict_module, "predict", record([]))
    import lambdanet.export as export_module

    exported = {"dynamic_batch": True, "input_shape": [2, 1, 16, 16], "check_batches": [1, 3], "checked": False,
                "path": "m.pt", "dtype": "float32", "external_data": None}  # fmt: skip
    monkeypatch.setattr(export_module, "export_model", record(exported))
    if argv[0] == "detect":
        pytest.importorskip("pycocotools")
        import lambdanet.tasks.detection.task as detect_trainer

        monkeypatch.setattr(detect_trainer, "train_detector", record({}))
    extra = {"eval": ["--checkpoint", str(tiny_digits_run)],
             "predict": [str(grey_image), "--checkpoint", str(tiny_digits_run)],
             "sample": ["--checkpoint", str(lm_run), "--prompt", "x"],
             "export": ["--checkpoint", str(tiny_digits_run), "--format", "torchscript", "--out",
                        str(tmp_path / "m.pt")]}.get(argv[-1], ["--out", str(tmp_path / "r")])  # fmt: skip
    assert main([*argv, *extra, "--threads", str(want)]) == 0
    assert seen == [want] and torch.get_num_threads() == before
    assert "--threads must be a positive int (CPU threads), got 0" in one_line_error(capsys, [*argv, *extra,
                                                                                               "--threads", "0"])
    assert seen == [want]  # nothing ran


def test_detect_threads_with_several_local_processes_is_refused(tmp_path, capsys):
    err = one_line_error(capsys, ["detect", "--procs", "2", "--threads", "1", "--out", str(tmp_path / "r")])
    assert "--threads sets the threads of one process" in err and "--procs 1" in err
    assert not (tmp_path / "r").exists()


def test_the_threads_flag_is_not_part_of_the_run_configuration(tmp_path):
    """--threads is how this process runs, not what the run computes: config.yaml does not hold it, so a
    resumed run is free to use another count."""
    import yaml

    out = tmp_path / "run"
    assert main(["train", "--epochs", "1", "--max-train-batches", "1", "--batch-size", "32", "--no-progress",
                 "--no-tensorboard", "--out", str(out), "--threads", "1"]) == 0
    assert "threads" not in yaml.safe_load((out / "config.yaml").read_text())
