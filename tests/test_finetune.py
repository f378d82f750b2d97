"""Fine-tuning: ``lambdanet train --pretrained | --checkpoint FILE`` starts from published (timm) weights with a
new classifier for the data's classes. The hub download is mocked: no test touches the network."""

import dataclasses
import math

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


# ------------------------------------------------------------------------- a run of lambdanet train, other channels
def _header_kwargs(weights_file):
    """The model keyword arguments recorded in a run's safetensors header (read directly, not through lambdanet)."""
    import json

    from safetensors import safe_open

    with safe_open(str(weights_file), framework="pt") as f:
        return json.loads(f.metadata()["model_kwargs"])


def _create_float64(name, **kwargs):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # float64 parameters from the start: float32 weights load exactly
    try:
        return lambdanet.create_model(name, **kwargs).eval()
    finally:
        torch.set_default_dtype(previous)


def test_adapt_input_conv_follows_timm_rule():
    """N -> 1: the sum over the N channels; N -> M: the channels repeated cyclically up to M, times N / M
    (expectations written out channel by channel). Tolerance: the rule computes in float64 and rounds once to
    float32 (2^-24 relative, and 2^-53 for the float64 scale); the expectation in float32 rounds the scale and
    the product (2^-24 each): under 2^-22 relative. Sums may cancel: their bound is absolute, 2^-24 of the
    rule's |sum| <= 3 max|w| plus the expectation's two additions of partial sums <= 3 max|w|: 9 * 2^-24 max|w|."""
    from lambdanet.models.pretrained import adapt_input_conv

    w = torch.randn(4, 3, 3, 3)
    close = dict(rtol=2 ** -22, atol=0)
    torch.testing.assert_close(adapt_input_conv(w, 1), w[:, 0:1] + w[:, 1:2] + w[:, 2:3], rtol=0,
                               atol=9 * 2 ** -24 * float(w.abs().max()))
    torch.testing.assert_close(adapt_input_conv(w, 5), torch.cat([w, w[:, :2]], 1) * (3 / 5), **close)
    torch.testing.assert_close(adapt_input_conv(w, 2), w[:, :2] * (3 / 2), **close)
    g = torch.randn(4, 1, 3, 3)
    torch.testing.assert_close(adapt_input_conv(g, 3), torch.cat([g, g, g], 1) / 3, **close)
    assert adapt_input_conv(w, 3) is w and adapt_input_conv(g, 3).dtype == torch.float32
    assert adapt_input_conv(g, 3, torch.float64).dtype == torch.float64


def test_grey_run_into_an_rgb_model_sees_a_replicated_grey_image_as_the_run_does(tiny_digits_run, tmp_path):
    """The 1-channel digits run loaded into a 3-channel model (create_model(in_chans=3, checkpoint_path=...)):
    the stem is the run's repeated over the channels and divided by 3, so an image whose three channels are
    the same grey image gives the run's logits. In float64: the adapted weight is rounded once (2^-53
    relative), the network's float64 sums (a few hundred terms per convolution, ~30 layers) add ~1e-13
    relative; a wrong rule (no division: the stem output tripled; only the first channel) is off by O(1).
    Bound: 1e-10 of the largest logit."""
    weights_file = tiny_digits_run / "model.safetensors"
    kwargs = _header_kwargs(weights_file)
    grey_model = _create_float64("lambda_resnet26", num_classes=10, in_chans=1, checkpoint_path=weights_file, **kwargs)
    rgb_model = _create_float64("lambda_resnet26", num_classes=10, in_chans=3, checkpoint_path=weights_file, **kwargs)
    notes = rgb_model.pretrained_cfg["load_notes"]
    assert notes == ["the input convolution stem.0.weight is adapted from the checkpoint's 1 input channel to the "
                     "model's 3 (repeated over them and scaled by 1/3)"]
    stem = grey_model.state_dict()["stem.0.weight"]
    # the rule multiplies by float64(1/3), the expectation divides by 3: 3 roundings of 2^-53 relative at most
    torch.testing.assert_close(rgb_model.state_dict()["stem.0.weight"], stem.repeat(1, 3, 1, 1) / 3,
                               rtol=2 ** -51, atol=0)
    grey = torch.randn(4, 1, 16, 16, dtype=torch.float64)
    with torch.no_grad():
        want, got = grey_model(grey), rgb_model(grey.expand(4, 3, 16, 16))
    assert (got - want).abs().max() <= 1e-10 * want.abs().max()
    # its preprocessing too: the run's grey statistics for each of the 3 channels (predict refused 1 for 3)
    cfg, run_cfg = rgb_model.pretrained_cfg, grey_model.pretrained_cfg
    assert cfg["input_size"][0] == 3 and cfg["mean"] == run_cfg["mean"] * 3 and cfg["std"] == run_cfg["std"] * 3
    from PIL import Image

    from lambdanet.predict import predict

    Image.fromarray((torch.rand(20, 20, 3) * 255).byte().numpy()).save(tmp_path / "rgb.png")
    assert len(predict(rgb_model.float(), [tmp_path / "rgb.png"], top_k=1)) == 1


def test_fine_tune_a_grey_run_directory_on_rgb_images(tiny_digits_run, folder, tmp_path, capsys):
    """The README's digits run (1 channel, small-image stem, 16 px) fine-tuned on an RGB image folder by its
    run directory, without --model, --model-kwargs or --img-size: the run's model, architecture and image size
    are taken from its header, the stem is adapted 1 -> 3 (logged), the classifier is new, and the run trains."""
    from safetensors.torch import load_file

    out = tmp_path / "ft"
    still = [a for a in STILL if a not in ("--img-size", "32")]  # the run's 16 px, from its header
    assert main(["train", "--checkpoint", str(tiny_digits_run), "--data", f"imagefolder:{folder}", *still,
                 "--out", str(out)]) == 0
    log = capsys.readouterr().out
    assert f"starting from {tiny_digits_run} ({tiny_digits_run / 'model.safetensors'})" in log
    assert ("adapted from the checkpoint's 1 input channel to the model's 3 (repeated over them and scaled by 1/3)"
            in log)
    import yaml

    saved = yaml.safe_load((out / "config.yaml").read_text())
    source = yaml.safe_load((tiny_digits_run / "config.yaml").read_text())
    assert (saved["model"], saved["img_size"], saved["model_kwargs"]) == (source["model"], 16, source["model_kwargs"])
    assert source["model_kwargs"]["stem"] == "cifar"  # the setting that the imagefolder's default (224 px) would lose
    # resuming re-resolves the saved configuration to itself (what --resume compares against)
    from lambdanet.tasks.classification import resolve_config

    again = dataclasses.asdict(resolve_config(overrides={"out": str(out), "resume": True}))
    assert {k: v for k, v in again.items() if k != "resume"} == {k: v for k, v in saved.items() if k != "resume"}
    rows = (out / "metrics.csv").read_text().strip().splitlines()
    assert len(rows) == 2 and math.isfinite(float(rows[1].split(",")[rows[0].split(",").index("train_loss")]))
    model = lambdanet.load_model(out, ema=False)
    assert model.pretrained_cfg["input_size"][0] == 3 and model.pretrained_cfg["classes"] == ["cats", "dogs"]
    assert model.fc.out_features == 2
    # the stem: the run's repeated and divided by 3 (the rule rounds once to float32, the expectation once, each
    # of the 2 updates once: 4 * 2^-24 relative), moved by at most lr = 1e-12 per AdamW step over the 2 steps
    original = load_file(tiny_digits_run / "model.safetensors")["stem.0.weight"]
    torch.testing.assert_close(model.state_dict()["stem.0.weight"], original.repeat(1, 3, 1, 1) / 3,
                               rtol=2 ** -22, atol=2 * 1e-12)


def test_fine_tuning_takes_a_run_s_settings_unless_given(tiny_digits_run, folder, tmp_path):
    """resolve_config with a run as checkpoint: the run's model, model_kwargs and image size; an explicit
    --img-size builds the model at that size with the run's stem; explicit model_kwargs override one option;
    another --model is refused. A run whose header has no stem / width keeps the model's own (not the
    small-image stem and compact width the resolved config would otherwise add at 32 px)."""
    from lambdanet.tasks.classification.data import dataset_spec
    from lambdanet.tasks.classification import resolve_config
    from lambdanet.engine.checkpoint import export_safetensors
    from lambdanet.files import weights_metadata
    from lambdanet.tasks.classification.task import build_model_for

    source = _header_kwargs(tiny_digits_run / "model.safetensors")
    data = f"imagefolder:{folder}"
    cfg = resolve_config(overrides={"checkpoint": str(tiny_digits_run), "data": data})
    # the header holds create_model's keywords: model_kwargs and the dropout / stochastic depth the config keeps apart
    assert cfg.model == "lambda_resnet26" and cfg.img_size == 16
    assert cfg.model_kwargs == {k: v for k, v in source.items() if k not in ("drop_rate", "drop_path_rate")}
    # dropout and stochastic depth are the new run's (here the model's defaults), not the checkpoint's
    fresh = resolve_config(overrides={"model": "lambda_resnet26", "data": data})
    assert (cfg.drop_rate, cfg.drop_path_rate) == (fresh.drop_rate, fresh.drop_path_rate)
    assert {k: cfg.model_kwargs[k] for k in ("stem", "base_width", "img_size")} == {
        "stem": "cifar", "base_width": 16, "img_size": 16}
    cfg = resolve_config(overrides={"checkpoint": str(tiny_digits_run), "data": data, "img_size": 24,
                                    "model_kwargs": {"zero_init_last": False}})
    assert cfg.img_size == 24 and cfg.model_kwargs["img_size"] == 24 and cfg.model_kwargs["stem"] == "cifar"
    assert cfg.model_kwargs["zero_init_last"] is False
    with pytest.raises(ValueError, match="model 'resnet26' does not match checkpoint .*which holds 'lambda_resnet26'"):
        resolve_config(overrides={"checkpoint": str(tiny_digits_run), "data": data, "model": "resnet26"})

    wide = lambdanet.create_model("resnet26", num_classes=4, in_chans=3, base_width=8, img_size=96)
    path = tmp_path / "wide.safetensors"
    export_safetensors(wide, path, weights_metadata(model="resnet26", model_kwargs={"base_width": 8, "img_size": 96},
                                                    num_classes=4, in_chans=3, classes=None, data="x",
                                                    image_size=96, mean=[0.5] * 3, std=[0.5] * 3))
    cfg = resolve_config(overrides={"checkpoint": str(path), "img_size": 32})  # digits: 1 channel, 32 px
    assert cfg.model == "resnet26" and cfg.model_kwargs["stem"] is None and cfg.model_kwargs["base_width"] == 8
    model = build_model_for(cfg, dataset_spec("digits"))  # the weights fit: same stem and widths
    assert "summed over them" in model.pretrained_cfg["load_notes"][-1]
    w = wide.state_dict()["stem.0.weight"]
    want = w[:, 0:1] + w[:, 1:2] + w[:, 2:3]
    # the rule's float64 sum rounded once to float32 (2^-24 |sum| <= 3 * 2^-24 max|w|); the expectation's two
    # float32 additions (2^-24 of partial sums <= 3 max|w| each): at most 9 * 2^-24 max|w| apart; sums may cancel,
    # so the bound is absolute
    torch.testing.assert_close(model.state_dict()["stem.0.weight"], want, rtol=0,
                               atol=9 * 2 ** -24 * float(w.abs().max()))


def test_a_timm_checkpoint_sets_the_input_size_of_its_architecture(folder, timm_file):
    """docs/pretrained.md: fine-tuning takes the checkpoint's input size by default, from ``--checkpoint FILE`` of a
    timm architecture as from ``--pretrained`` (it took the data's, 224 for a folder: global attention then
    refused the checkpoint), and ``--img-size`` overrides it."""
    from lambdanet.tasks.classification.config import resolve_config

    path, _ = timm_file
    data = f"imagefolder:{folder}"
    assert resolve_config(overrides={"model": "lambda_resnet26t", "checkpoint": str(path), "data": data}).img_size \
        == lambdanet.models.model_info("lambda_resnet26t").input_size == 256
    assert resolve_config(overrides={"model": "lambda_resnet26t", "pretrained": True, "data": data}).img_size == 256
    given = resolve_config(overrides={"model": "lambda_resnet26t", "checkpoint": str(path), "data": data,
                                      "img_size": 160})  # fmt: skip
    assert given.img_size == 160
    no_weights = resolve_config(overrides={"model": "lambda_resnet26t", "data": data})
    assert no_weights.img_size == 224  # the data's size
