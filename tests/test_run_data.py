"""What a classification run keeps of its data, and how its images are read: a checkpoint loads with the classes it
trained on whatever its data folder holds now (and refuses data that changed), predict preprocesses a run's
images as the run evaluated them, unreadable and 16-bit images, relative data paths, pseudo-label agreement."""

from __future__ import annotations

import math
import os
import re
import shutil

import numpy as np
import pytest
import torch

import lambdanet
from lambdanet.cli import main
from lambdanet.engine.checkpoint import load_checkpoint
from lambdanet.files import absolute_data, read_image
from lambdanet.predict import load_image, preprocess_transform
from lambdanet.tasks.classification import evaluate_checkpoint, resolve_config, train
from lambdanet.tasks.classification.data import build_datasets, build_transforms, split_indices

QUICK = dict(epochs=1, max_train_batches=2, batch_size=4, img_size=16, progress=False, tensorboard=False)


@pytest.fixture()
def folder_run(tmp_path, image_folder):
    """A run on a copy of conftest's two-class folder (which tests only read): (run directory, its data)."""
    data = tmp_path / "imgs"
    shutil.copytree(image_folder, data)
    out = tmp_path / "run"
    train(resolve_config(overrides={**QUICK, "data": f"imagefolder:{data}", "out": str(out)}))
    return out, data


def test_a_checkpoint_keeps_its_classes_when_its_data_folder_changes(folder_run, tmp_path, capsys):
    out, data = folder_run
    before = lambdanet.load_model(out / "last.pt")
    x = torch.randn(2, 3, 16, 16)
    assert before.pretrained_cfg["classes"] == ["cats", "dogs"] and before.fc.out_features == 2
    for split in ("train", "val"):  # a third class appears in the data folder after the run
        shutil.copytree(data / split / "cats", data / split / "birds")
    after = lambdanet.load_model(out / "last.pt")  # used to rebuild a fresh 3-way head from the folder
    assert after.pretrained_cfg["classes"] == ["cats", "dogs"] and torch.equal(after(x), before(x))
    changed = r"classifies 2 classes \(cats, dogs\) of 3-channel images; .* has 3 classes \(birds, cats, dogs\)"
    with pytest.raises(ValueError, match=changed):
        evaluate_checkpoint(out)
    assert main(["train", "--out", str(out), "--resume", "--epochs", "2", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert re.search(changed, err) and "\n" not in err
    shutil.move(data, tmp_path / "moved")  # the data gone: the checkpoint still loads, with its classes
    assert torch.equal(lambdanet.load_model(out / "last.pt")(x), before(x))


def test_the_classes_message_counts_one_class_in_the_singular(tmp_path):
    """A data folder left with one class reads "1 class (cats)", not "1 classes"."""
    from types import SimpleNamespace

    from lambdanet.tasks.classification.load import check_data_fits

    meta = {"num_classes": 2, "in_chans": 3, "classes": ["cats", "dogs"]}
    spec = SimpleNamespace(name="imagefolder:x", num_classes=1, in_chans=3, classes=["cats"])
    with pytest.raises(ValueError, match=r"classifies 2 classes \(cats, dogs\) of 3-channel images; imagefolder:x has "
                                         r"1 class \(cats\) of 3-channel images: "):
        check_data_fits(meta, spec, tmp_path / "last.pt")


def test_renamed_class_folders_are_refused_and_older_checkpoints_checked_by_their_classifier(folder_run, capsys):
    out, data = folder_run
    for split in ("train", "val"):  # as many classes, other names: the labels' meaning changed
        (data / split / "dogs").rename(data / split / "wolves")
    assert main(["train", "--out", str(out), "--resume", "--epochs", "2", "--no-progress"]) == 2
    assert "classifies 2 classes (cats, dogs)" in capsys.readouterr().err
    for split in ("train", "val"):
        shutil.copytree(data / split / "cats", data / split / "birds")
    ckpt = load_checkpoint(out / "last.pt")
    del ckpt["run_meta"]  # as an earlier version wrote it: the data folder is all it knows of its classes
    torch.save(ckpt, out / "last.pt")
    with pytest.raises(ValueError, match="has a classifier of 2 classes but its data imagefolder:.* has 3 now"):
        lambdanet.load_model(out / "last.pt")
    assert main(["train", "--out", str(out), "--resume", "--epochs", "2", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()  # torch's size-mismatch listing in one line
    assert re.search(r"fc\.weight \[2, \d+\] in the checkpoint, \[3, \d+\] now", err) and "\n" not in err


def test_predict_preprocesses_a_folder_runs_images_as_the_run_evaluated(folder_run):
    out, data = folder_run
    model = lambdanet.load_model(out)
    cfg = model.pretrained_cfg
    assert cfg["crop_pct"] == 0.875  # file datasets evaluate with a centre crop, the built-in ones resize straight
    spec, _, val = build_datasets(f"imagefolder:{data}")
    evaluated = build_transforms(spec, 16, train=False)(val[0][0])  # 20 x 24 image: not square
    predicted = preprocess_transform(cfg)(load_image(val.folder.samples[0][0], 3))
    # the run's path resizes uint8 pixels, predict's float ones: a rounding of 1/255 or two apart after the
    # normalisation (std >= 0.224); the old stretch to 16 x 16 instead of the crop differed by up to ~2
    assert predicted.shape == evaluated.shape == (3, 16, 16)
    assert (predicted - evaluated).abs().max() < 2 / 255 / min(spec.std)


def test_an_unreadable_image_is_one_line_naming_it(tmp_path, image_folder, capsys):
    data = tmp_path / "imgs"
    shutil.copytree(image_folder, data)
    (data / "train" / "cats" / "bad.png").write_bytes(b"garbage")
    for workers in ("0", "1"):  # in a DataLoader worker too (its traceback used to be the message)
        code = main(["train", "--data", f"imagefolder:{data}", "--epochs", "1", "--batch-size", "4", "--img-size",
                     "16", "--workers", workers, "--no-progress", "--no-tensorboard", "--out",
                     str(tmp_path / f"run{workers}")])  # fmt: skip
        err = capsys.readouterr().err.strip()
        assert code == 2 and "bad.png is not a readable image (UnidentifiedImageError" in err and "\n" not in err


def test_sixteen_bit_images_are_scaled_not_clipped(tmp_path):
    from PIL import Image

    wide = np.linspace(0, 65535, 64 * 4).reshape(4, 64).astype(np.uint16)  # a full-range gradient
    Image.fromarray(wide).save(tmp_path / "g16.png")
    got = np.asarray(read_image(tmp_path / "g16.png", "L"))
    assert np.array_equal(got, np.rint(wide / 257.0).astype(np.uint8))  # PIL's convert: 99% at 255
    assert np.asarray(load_image(tmp_path / "g16.png", 3)).shape == (4, 64, 3)


def test_float_images_in_either_scale_read_as_their_8_bit_values_and_others_are_refused(tmp_path):
    """A float TIFF (``F``) in [0, 1] is the 8-bit image times 1/255 (PIL's own conversion made it black), one in
    [0, 255] the 8-bit values; negative, non-finite or larger values have no known scale: one line naming it."""
    from PIL import Image

    grey = np.arange(256, dtype=np.uint8).reshape(16, 16)
    for name, scale in (("unit.tiff", 1 / 255), ("byte.tiff", 1.0)):
        Image.fromarray((grey * scale).astype(np.float32)).save(tmp_path / name)
        assert np.array_equal(np.asarray(read_image(tmp_path / name, "L")), grey), name
    for bad in (-0.5, 300.0, np.nan):
        Image.fromarray(np.full((4, 4), bad, np.float32)).save(tmp_path / "bad.tiff")
        with pytest.raises(ValueError, match=r"bad.tiff holds float pixels outside \[0, 1\] and \[0, 255\]"):
            read_image(tmp_path / "bad.tiff", "RGB")


def test_relative_data_paths_are_stored_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert absolute_data("imagefolder:imgs") == f"imagefolder:{tmp_path / 'imgs'}"
    assert absolute_data("text:~/corpus").startswith("text:/") and absolute_data("digits") == "digits"
    cfg = resolve_config(overrides={"data": "imagefolder:imgs", "out": str(tmp_path / "r"), "img_size": 16})
    assert cfg.data == f"imagefolder:{tmp_path / 'imgs'}"


def test_pseudo_label_agreement_counts_the_labels_kept(tmp_path, capsys):
    teacher = tmp_path / "teacher"
    train(resolve_config(overrides={**QUICK, "img_size": None, "batch_size": 32, "max_train_batches": 6,
                                    "labeled_fraction": 0.3, "out": str(teacher)}))  # fmt: skip
    _, train_ds, _ = build_datasets("digits")
    for threshold in ("0.3", "0.99"):
        out = tmp_path / f"pl{threshold}.pt"
        assert main(["pseudo-label", "--checkpoint", str(teacher), "--threshold", threshold, "--out", str(out)]) == 0
        pl = torch.load(out, weights_only=True)
        truth = torch.tensor([train_ds[int(i)][1] for i in pl["indices"]], dtype=torch.long)
        if len(truth):
            assert pl["agreement_with_true_labels"] == pytest.approx(float((pl["labels"] == truth).double().mean()))
        else:
            assert math.isnan(pl["agreement_with_true_labels"]) and "none reaches" in capsys.readouterr().out


def test_output_to_a_closed_pipe_ends_quietly():
    """lambdanet predict --json | head: the reader goes away; no BrokenPipeError traceback, SIGPIPE's status."""
    import subprocess
    import sys

    code = ("import os, sys; r, w = os.pipe(); os.close(r); os.dup2(w, 1)\n"
            "from lambdanet.cli import main; sys.exit(main(['models', '--no-flops', 'lambda_resnet26*']))")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # output flushed at exit, buffered
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 141 and "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr


def test_weights_files_get_the_mode_of_the_runs_other_files(tmp_path):
    """safetensors creates its files 0600; the run's weights take the mode any new file gets (the umask's)."""
    from lambdanet.engine.checkpoint import export_safetensors

    old = os.umask(0o022)  # the usual mask (0600 would pass under 077)
    try:
        export_safetensors(torch.nn.Linear(2, 2), tmp_path / "model.safetensors")
        (tmp_path / "other.txt").write_text("x")
    finally:
        os.umask(old)
    modes = [os.stat(tmp_path / name).st_mode & 0o777 for name in ("model.safetensors", "other.txt")]
    assert modes == [0o644, 0o644]


def test_eval_on_another_dataset_normalises_images_as_the_model_trained(tiny_digits_run):
    """``eval --data`` of a digits run on MNIST: the images are normalised with the run's mean and std (those of
    its training, which predict applies too), not with the evaluated dataset's (it used MNIST's 0.13 / 0.31)."""
    from lambdanet.tasks.classification.data import resize_images

    res = evaluate_checkpoint(tiny_digits_run, data="mnist5k")
    model = lambdanet.load_model(tiny_digits_run / "last.pt")
    cfg = model.pretrained_cfg
    _, _, test = build_datasets("mnist5k")
    x = resize_images(test.images, cfg["input_size"][-1]).double() / 255  # n 1 16 16, as the run's images
    mean, std = torch.tensor(cfg["mean"]).view(1, -1, 1, 1), torch.tensor(cfg["std"]).view(1, -1, 1, 1)
    assert cfg["mean"] == [0.3] and cfg["std"] == [0.38]  # digits' statistics, not MNIST's
    with torch.no_grad():
        logits = model(((x - mean) / std).float()).double()
    loss = torch.nn.functional.cross_entropy(logits, test.labels).item()
    top1 = (logits.argmax(1) == test.labels).double().mean().item()
    # float32 logits of order 1-10, summed over 1000 images in another order: 1e-4 covers the rounding
    assert res["samples"] == len(test.labels) and res["loss"] == pytest.approx(loss, rel=1e-4)
    assert res["top1"] == pytest.approx(top1, abs=1.5 / len(test.labels))


@pytest.mark.parametrize(
    "args,needle",
    [  # 1438 training images: 0.0003 of them rounds to none (and 0.0003 of 719 too)
        (["--val-split", "0.0003"], "val_split=0.0003 holds out none of the 1438 training images of digits; pass "
                                    "--val-split 0.0007 or more (one image), or 0 for no validation split"),
        (["--val-split", "0.0003", "--labeled-fraction", "0.5"],
         "holds out none of the 719 training images of digits left by --labeled-fraction 0.5; pass --val-split 0.0014"),
    ],
)  # fmt: skip
def test_a_validation_split_of_no_image_is_refused_in_one_line(tmp_path, capsys, args, needle):
    """It used to train, report a validation top-1 of 0 (over no images) and select the first epoch as the best."""
    code = main(["train", *args, "--epochs", "1", "--out", str(tmp_path / "run"), "--no-progress", "--no-tensorboard"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and needle in err and "\n" not in err
    assert split_indices(719, 0.0014, 1)[1].size == split_indices(1438, 0.0007, 1)[1].size == 1  # the advice holds


def test_an_image_folder_of_one_class_is_refused_in_one_line(tmp_path, image_folder, capsys):
    """One class folder trains a classifier whose loss is 0 from the first step: nothing to learn."""
    data = tmp_path / "imgs"
    for split in ("train", "val"):
        shutil.copytree(image_folder / split / "cats", data / split / "cats")
    code = main(["train", "--data", f"imagefolder:{data}", "--epochs", "1", "--batch-size", "4", "--img-size", "16",
                 "--no-progress", "--no-tensorboard", "--out", str(tmp_path / "run")])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err
    assert f"imagefolder:{data} has one class folder (cats): classification needs two or more" in err


# One level of uint8 (1/255) before the normalisation: torchvision resizes uint8 images in fixed point and rounds the
# result to integers (<= 0.5 level each), predict resizes the float image; divided by the smallest std.
LEVEL = 1 / 255


@pytest.mark.parametrize("crop_pct", [1.0, 0.875])
def test_eval_transforms_of_files_crop_as_predict_does(crop_pct):
    """``build_transforms`` (evaluation) of an image file crops as ``predict`` does with the same ``crop_pct``: the
    0.875 centre crop of a run on files, the straight resize of a run on a small built-in dataset (a CIFAR run
    evaluated on an image folder was centre-cropped, which it never saw in training, where predict is not)."""
    from lambdanet.tasks.classification.datasets import DatasetSpec

    spec = DatasetSpec("imagefolder:x", 2, 3, 24, (0.5, 0.4, 0.3), (0.25, 0.2, 0.3), True, False)
    img = (torch.rand(3, 40, 52, generator=torch.Generator().manual_seed(0)) * 255).to(torch.uint8)
    got = build_transforms(spec, 24, train=False, crop_pct=crop_pct)(img)
    cfg = {"input_size": (3, 24, 24), "mean": spec.mean, "std": spec.std, "crop_pct": crop_pct}
    want = preprocess_transform(cfg)(img.permute(1, 2, 0).numpy())
    other = preprocess_transform({**cfg, "crop_pct": 1.875 - crop_pct})(img.permute(1, 2, 0).numpy())
    assert got.shape == want.shape == (3, 24, 24)
    assert (got - want).abs().max() <= LEVEL / min(spec.std) + 1e-6
    assert (got - other).abs().max() > 10 * LEVEL / min(spec.std)  # the other crop: far apart (the check can fail)


def test_eval_of_a_file_run_on_small_images_crops_as_the_run_evaluated(folder_run, monkeypatch):
    """``eval --data OTHER`` of a run on image files, evaluated on small in-memory images (as CIFAR is): the images
    are resized to ``size / 0.875`` and centre-cropped, as the run evaluated and as predict feeds its model; they
    were resized straight."""
    from lambdanet.tasks.classification import task as task_module
    from lambdanet.tasks.classification.datasets import DatasetSpec, TensorImages

    out, data = folder_run
    g = torch.Generator().manual_seed(4)
    images = (torch.rand(6, 3, 40, 40, generator=g) * 255).to(torch.uint8)
    labels = torch.tensor([0, 1, 0, 1, 1, 0])
    small = DatasetSpec("small-rgb", 2, 3, 32, (0.5,) * 3, (0.25,) * 3, True, True)  # (its own statistics unused)
    monkeypatch.setattr(task_module, "build_datasets", lambda *a, **k: (small, None, TensorImages(images, labels)))
    fed, evaluate = [], task_module.evaluate
    monkeypatch.setattr(task_module, "evaluate", lambda model, loader, **kw: fed.append(next(iter(loader))[0])
                        or evaluate(model, loader, **kw))  # fmt: skip
    res = evaluate_checkpoint(out, data="small-rgb")
    cfg = lambdanet.load_model(out / "last.pt").pretrained_cfg
    assert res["samples"] == 6 and cfg["crop_pct"] == 0.875
    want = torch.stack([preprocess_transform(cfg)(im.permute(1, 2, 0).numpy()) for im in images])
    straight = torch.stack([preprocess_transform({**cfg, "crop_pct": 1.0})(im.permute(1, 2, 0).numpy())
                            for im in images])  # fmt: skip
    assert fed[0].shape == want.shape == (6, 3, 16, 16)
    assert (fed[0] - want).abs().max() <= LEVEL / min(cfg["std"]) + 1e-6  # the images predict feeds the model
    assert (fed[0] - straight).abs().max() > 10 * LEVEL / min(cfg["std"])  # (what it was fed before)


def test_in_memory_datasets_are_resized_a_chunk_at_a_time_to_the_same_pixels():
    """Every image of a built-in dataset was resized in one float32 tensor (fashion-mnist at 224 px: 12 GB at
    once, CIFAR-10 at a pretrained model's 256: 39 GB): a chunk at a time into the uint8 result, the same pixels as
    one whole-batch resize (each image's interpolation is its own) and a peak of a chunk's float copies."""
    from lambdanet.runtime import peak_memory
    from lambdanet.tasks.classification.data import resize_images

    images = torch.randint(0, 256, (40, 1, 28, 28), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    whole = torch.nn.functional.interpolate(images.float(), size=(96, 96), mode="bilinear", antialias=True,
                                            align_corners=False).round().clamp(0, 255).to(torch.uint8)  # fmt: skip
    assert torch.equal(resize_images(images, 96, chunk=7), whole) and torch.equal(resize_images(images, 96), whole)
    result, one_float_copy = whole.numel(), whole.numel() * 4  # bytes
    peak = peak_memory(lambda: resize_images(images, 96, chunk=4))
    assert peak <= result + 3 * 4 * 96 * 96 * 4 < one_float_copy  # the uint8 result and a few chunk-sized floats
