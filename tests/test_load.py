"""Reload what ``lambdanet train`` trained: ``lambdanet.load_model`` from a run directory, its safetensors
weights (which describe their model in the file's header) or its checkpoint."""

import pytest
import torch
from safetensors.torch import save_model

import lambdanet
from lambdanet.tasks.classification.data import ImageLoader, build_datasets
from lambdanet.models import create_model
from lambdanet.tasks.classification import resolve_config, train

FAST = dict(epochs=2, max_train_batches=3, batch_size=32, progress=False, tensorboard=False)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("load") / "run"
    summary = train(resolve_config(overrides={**FAST, "out": str(out), "ema_decay": 0.9}))
    return out, summary


def _test_accuracy(model, image_size):
    spec, _, test = build_datasets("digits")
    loader = ImageLoader(test, spec, image_size, train=False, batch_size=256)  # as the trainer evaluates
    with torch.no_grad():
        hits = sum(int((model(x).argmax(1) == y).sum()) for x, y in loader)
    return hits / len(test)


def test_load_model_from_a_run_directory_reproduces_the_reported_accuracy(run):
    out, summary = run
    model = lambdanet.load_model(out)  # the EMA weights, which the summary reports
    cfg = model.pretrained_cfg
    assert (cfg["architecture"], cfg["num_classes"], cfg["input_size"]) == ("lambda_resnet26", 10, (1, 16, 16))
    assert cfg["mean"] == [0.30] and cfg["std"] == [0.38] and not model.training
    assert sum(p.numel() for p in model.parameters()) == summary["params"]
    assert _test_accuracy(model, cfg["input_size"][-1]) == pytest.approx(summary["final_acc"], abs=1e-12)


def test_every_form_of_a_run_loads_the_same_weights(run):
    out, summary = run
    x = torch.randn(3, 1, 16, 16)
    raw = lambdanet.load_model(out / "model.safetensors")
    assert _test_accuracy(raw, 16) == pytest.approx(summary["final_acc_raw_weights"], abs=1e-12)
    for other in (lambdanet.load_model(out / "last.pt", ema=False), lambdanet.load_model(out, ema=False)):
        torch.testing.assert_close(other(x), raw(x), rtol=0, atol=0)
    ema_ckpt = lambdanet.load_model(out / "last.pt")
    ema_file = lambdanet.load_model(out / "model_ema.safetensors")
    torch.testing.assert_close(ema_ckpt(x), ema_file(x), rtol=0, atol=0)


def test_weights_without_a_model_description_get_a_clear_error(tmp_path):
    path = tmp_path / "plain.safetensors"
    save_model(create_model("resnet26", num_classes=10, in_chans=1, base_width=8), str(path))
    with pytest.raises(ValueError, match="without lambdanet's model description"):
        lambdanet.load_model(path)
    with pytest.raises(ValueError, match="holds no trained model"):
        lambdanet.load_model(tmp_path)


def test_create_model_with_a_run_checkpoint_takes_its_weights_and_class_names(run):
    """``create_model(name, checkpoint_path=run's model.safetensors)`` (lambdanet's own keys, loaded as they
    are) gives the model ``load_model`` rebuilds, and the run's classes and preprocessing."""
    import json

    from safetensors import safe_open

    out, _ = run
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        kwargs = json.loads(f.metadata()["model_kwargs"])
    model = create_model("lambda_resnet26", num_classes=10, in_chans=1, checkpoint_path=out / "model.safetensors",
                         **kwargs).eval()
    ref = lambdanet.load_model(out / "model.safetensors")
    x = torch.randn(3, 1, 16, 16)
    torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)
    for key in ("classes", "input_size", "mean", "std"):
        assert model.pretrained_cfg[key] == ref.pretrained_cfg[key], key


def _truncated_copies(src, tmp_path):
    """``src`` cut inside its tensor data and inside its header."""
    data = src.read_bytes()
    cut = {"data": data[: len(data) // 2], "header": data[:100]}
    paths = []
    for name, part in cut.items():
        (tmp_path / name).mkdir()
        path = tmp_path / name / "model.safetensors"
        path.write_bytes(part)
        paths.append(path)
    return paths


def test_truncated_safetensors_get_a_one_line_error_everywhere(tiny_digits_run, tmp_path, capsys):
    """A truncated weights file: one line naming it as corrupted or truncated, from load_model (the file or its
    run directory), create_model(checkpoint_path=...), and the predict / export / train commands."""
    from PIL import Image

    from lambdanet.cli import main

    image = tmp_path / "grey.png"
    Image.new("L", (8, 8), 128).save(image)
    for path in _truncated_copies(tiny_digits_run / "model.safetensors", tmp_path):
        for source in (path, path.parent):
            with pytest.raises(ValueError, match=f"weights file {path} is corrupted or truncated"):
                lambdanet.load_model(source)
        with pytest.raises(ValueError, match="is corrupted or truncated"):
            create_model("lambda_resnet26", num_classes=10, in_chans=1, checkpoint_path=path)
        for argv in (["predict", str(image), "--checkpoint", str(path)],
                     ["export", "--checkpoint", str(path), "--format", "torchscript", "--no-check",
                      "--out", str(tmp_path / "m.pt")],
                     ["train", "--checkpoint", str(path), "--out", str(tmp_path / "run"), "--no-progress"]):
            assert main(argv) == 2, argv
            err = capsys.readouterr().err.strip()
            assert f"weights file {path} is corrupted or truncated" in err and len(err.splitlines()) == 1, err


def test_create_model_takes_a_run_directory_as_load_model_does(run):
    """create_model(checkpoint_path=RUN_DIR) loads the file load_model(RUN_DIR) loads (the EMA weights here)."""
    out, _ = run
    import json

    from safetensors import safe_open

    with safe_open(str(out / "model_ema.safetensors"), framework="pt") as f:
        kwargs = json.loads(f.metadata()["model_kwargs"])
    model = create_model("lambda_resnet26", num_classes=10, in_chans=1, checkpoint_path=out, **kwargs).eval()
    assert model.pretrained_cfg["weights"] == str(out / "model_ema.safetensors")
    x = torch.randn(3, 1, 16, 16)
    torch.testing.assert_close(model(x), lambdanet.load_model(out)(x), rtol=0, atol=0)


def test_shared_embeddings_round_trip_through_every_loader(tmp_path):
    """safetensors stores a shared tensor once (share_embeddings: one position embedding for several lambda
    layers); load_model and create_model(checkpoint_path=...) fill the other names in and give the saved model."""
    from lambdanet.engine.checkpoint import export_safetensors
    from lambdanet.files import weights_metadata

    kwargs = {"stem": "cifar", "base_width": 8, "img_size": 16, "share_embeddings": True}
    src = create_model("lambda_resnet26", num_classes=10, in_chans=1, **kwargs).eval()
    with torch.no_grad():
        for p in src.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # not the initialisation a fresh model would have
    path = tmp_path / "model.safetensors"
    export_safetensors(src, path, weights_metadata(model="lambda_resnet26", model_kwargs=kwargs, num_classes=10,
                                                   in_chans=1, classes=None, data="digits", image_size=16,
                                                   mean=[0.3], std=[0.38]))
    x = torch.randn(2, 1, 16, 16)
    want = src(x)
    again = create_model("lambda_resnet26", num_classes=10, in_chans=1, checkpoint_path=path, **kwargs).eval()
    for model in (lambdanet.load_model(path), again):
        torch.testing.assert_close(model(x), want, rtol=0, atol=0)
        emb = model.state_dict()
        shared = emb["stages.3.1.spatial.embedding.weight"].data_ptr()
        assert emb["stages.2.0.spatial.embedding.weight"].data_ptr() == shared


@pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated")  # any category: 2.14 Future-, 2.11 Deprecation-
def test_predict_and_export_take_a_runs_raw_weights_with_no_ema(run, tmp_path, capsys):
    """``--no-ema`` (as ``eval``'s): the raw weights of a run that kept an EMA, ``load_model(run, ema=False)``."""
    import json

    from PIL import Image

    from lambdanet.cli import main
    from lambdanet.predict import predict

    out, _ = run
    image = tmp_path / "g.png"
    Image.fromarray((torch.rand(8, 8) * 255).to(torch.uint8).numpy(), mode="L").save(image)
    raw, ema = lambdanet.load_model(out, ema=False), lambdanet.load_model(out)
    for flags, model in (([], ema), (["--no-ema"], raw)):
        assert main(["predict", str(image), "--checkpoint", str(out), "--json", "--top-k", "10", *flags]) == 0
        assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(predict(model, image, top_k=10)))
    assert predict(raw, image, top_k=10) != predict(ema, image, top_k=10)  # the flag decides something
    argv = ["export", "--checkpoint", str(out), "--format", "torchscript", "--no-check", "--no-ema"]
    assert main([*argv, "--out", str(tmp_path / "raw.pt")]) == 0
    x = torch.randn(2, 1, 16, 16)
    with torch.no_grad():  # a trace replays the eager kernels: the same bits
        assert torch.equal(torch.jit.load(str(tmp_path / "raw.pt"))(x), raw(x))
