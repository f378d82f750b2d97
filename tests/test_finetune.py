"""Fine-tuning: ``lambdanet train --pretrained | --checkpoint FILE`` starts from published (timm) weights with a
new classifier for the data's classes. The hub download is mocked: no test touches the network."""

import pytest
import torch

import lambdanet
from lambdanet.cli import main
from lambdanet.models import pretrained as weights

timm = pytest.importorskip("timm")


@pytest.fixture(scope="module")
def folder(image_folder):
    """Two classes, 6 train and 6 val images each (conftest's ``image_folder``)."""
    return image_folder


@pytest.fixture(scope="module")
def timm_file(tmp_path_factory):
    torch.manual_seed(0)
    peer = timm.create_model("lambda_resnet26t")
    path = tmp_path_factory.mktemp("timm") / "lambda_resnet26t.pth"
    torch.save(peer.state_dict(), path)
    return path, peer.state_dict()


# lr 1e-12 and no warm-up: the trunk stays the checkpoint's (AdamW moves a weight by about lr per step)
STILL = ["--epochs", "1", "--max-train-batches", "2", "--batch-size", "4", "--img-size", "32", "--lr", "1e-12",
         "--warmup-epochs", "0", "--schedule", "constant", "--no-progress", "--no-tensorboard"]


def _check_started_from(run, timm_state):
    model = lambdanet.load_model(run, ema=False)
    assert model.fc.out_features == 2 and model.pretrained_cfg["classes"] == ["cats", "dogs"]
    got = model.state_dict()
    stem, kernel = timm_state["stem.conv1.conv.weight"], timm_state["stages.3.1.self_attn.conv_lambda.weight"]
    assert (got["stem.conv1.conv.weight"] - stem).abs().max() <= 1e-9
    assert (got["stages.3.1.self_attn.embedding.weight"] - kernel.reshape(kernel.shape[0], -1)).abs().max() <= 1e-9
    assert (got["stem.conv1.conv.weight"] - stem).abs().max() < 1e-3 * stem.abs().max() < 1  # not a fresh init
    fresh = lambdanet.create_model("lambda_resnet26t", num_classes=2).state_dict()["stem.conv1.conv.weight"]
    assert (fresh - stem).abs().max() > 1e-2
    # the run's weights through create_model: its class names come with them
    again = lambdanet.create_model("lambda_resnet26t", num_classes=2, checkpoint_path=run / "model.safetensors",
                                   img_size=32)
    assert again.pretrained_cfg["classes"] == ["cats", "dogs"] and again.pretrained_cfg["load_notes"] == []


def test_train_from_a_timm_checkpoint_file(folder, timm_file, tmp_path, capsys):
    path, state = timm_file
    run = tmp_path / "run"
    assert main(["train", "--model", "lambda_resnet26t", "--checkpoint", str(path), "--data", f"imagefolder:{folder}",
                 *STILL, "--out", str(run)]) == 0
    out = capsys.readouterr().out
    assert f"starting from {path}" in out and "1000-class classifier is not loaded" in out
    _check_started_from(run, state)


def test_train_pretrained_downloads_once_then_fine_tunes(folder, timm_file, tmp_path, monkeypatch, capsys):
    path, state = timm_file
    calls = []
    monkeypatch.setattr(weights, "download_weights", lambda repo: calls.append(repo) or str(path))
    monkeypatch.setenv("LAMBDANET_CACHE", str(tmp_path / "cache"))
    run = tmp_path / "run"
    assert main(["train", "--model", "lambda_resnet26t", "--pretrained", "--data", f"imagefolder:{folder}", *STILL,
                 "--out", str(run)]) == 0
    assert calls == ["timm/lambda_resnet26t.c1_in1k"]
    assert "starting from lambda_resnet26t's published weights" in capsys.readouterr().out
    _check_started_from(run, state)


def test_fixed_size_checkpoint_at_another_size_is_a_clear_error(folder, tmp_path, capsys):
    path = tmp_path / "botnet.pth"
    torch.save(timm.create_model("botnet26t_256").state_dict(), path)
    assert main(["train", "--model", "botnet26t_256", "--checkpoint", str(path), "--data", f"imagefolder:{folder}",
                 *STILL, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert "does not fit botnet26t_256" in err and "build the model at the checkpoint's" in err
    assert len(err.splitlines()) == 1


def test_pretrained_and_checkpoint_together_are_refused(tmp_path, capsys):
    assert main(["train", "--model", "lambda_resnet26t", "--pretrained", "--checkpoint", "x.pth",
                 "--out", str(tmp_path / "run")]) == 2
    assert "not both" in capsys.readouterr().err
