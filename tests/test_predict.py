"""``lambdanet.predict.predict`` and ``lambdanet predict``: image files in, top-k classes out, preprocessed as
the model's ``pretrained_cfg`` says; checked against a reference computed by hand in float64.

Tolerance of the float32 pipeline against the float64 reference: every op of the float32 forward pass rounds
its result (a few eps32 of its scale for the blocked sums of convolutions and GEMMs); to first order these
errors add along the network, so the logits may differ by ``4 * N * eps32 * max|logits|`` with ``N`` the
network's leaf modules (more than its ops on any path). A softmax probability moves by at most half the
largest logit change (the rows of the softmax Jacobian sum to ``2 p (1 - p) <= 1/2`` in absolute value).

In float16 / bfloat16 (``--dtype``) every op rounds its output to the half type (eps 2**-10 / 2**-7); the linear
bound ``4 * N * eps`` then exceeds 1, but the roundings are independent in sign and add in quadrature (the
probabilistic rounding-error bound, Higham and Mary 2019): ``4 * sqrt(N) * eps * max|logits|``.
"""

import copy
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

import lambdanet
from lambdanet.cli import main
from lambdanet.tasks.classification.data import build_datasets
from lambdanet.predict import find_images, predict

EPS32 = torch.finfo(torch.float32).eps


@pytest.fixture(scope="module")
def run(tiny_digits_run):
    """A digits run (lambda_resnet26 with the small-image stem, 1 channel, 16x16) trained for a few steps."""
    return tiny_digits_run


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """Eight real 8x8 test digits as image files: PNGs at the top, a .PNG and a .bmp in a subfolder, and a
    text file that a folder listing must skip."""
    root = tmp_path_factory.mktemp("digits")
    (root / "more").mkdir()
    _, _, test = build_datasets("digits")
    names = [f"{i}.png" for i in range(6)] + ["more/6.PNG", "more/7.bmp"]
    for i, name in enumerate(names):
        image, _ = test[i]  # uint8 [1, 8, 8]
        Image.fromarray(image[0].numpy(), mode="L").save(root / name)
    (root / "more" / "notes.txt").write_text("not an image")
    return root


def by_hand(files, model):
    """Probabilities of ``model`` (in float64) on ``files`` preprocessed as the digits run was trained: 8-bit
    grayscale scaled to [0, 1], bilinear antialiased resize to 16x16, normalised with the digits mean 0.30 and
    std 0.38 (lambdanet.tasks.classification.datasets)."""
    pixels = np.stack([np.asarray(Image.open(f), dtype=np.float64) / 255.0 for f in files])  # n 8 8
    x = F.interpolate(torch.from_numpy(pixels)[:, None], size=(16, 16), mode="bilinear", antialias=True,
                      align_corners=False)  # n 1 16 16
    x = (x - 0.30) / 0.38
    ref = copy.deepcopy(model).double().eval()
    with torch.no_grad():
        logits = ref(x)  # n 10
    return logits, logits.softmax(dim=1)


def test_predict_equals_the_model_applied_by_hand(run, digits):
    model = lambdanet.load_model(run)
    results = predict(model, [digits], top_k=10)
    files = [digits / f"{i}.png" for i in range(6)] + [digits / "more" / "6.PNG", digits / "more" / "7.bmp"]
    assert [r["image"] for r in results] == [str(f) for f in files]  # sorted, recursive, .txt skipped
    logits, probs = by_hand(files, model)
    n_modules = sum(1 for m in model.modules() if not list(m.children()))
    logit_tol = 4 * n_modules * EPS32 * logits.abs().max().item()  # see the module docstring
    for r, p in zip(results, probs):
        top = r["top_k"]
        assert [c["index"] for c in top] == p.argsort(descending=True).tolist()
        assert top[0]["label"] == str(int(p.argmax()))  # digits' classes are unnamed: labels are the indices
        assert all(c["label"] == str(c["index"]) for c in top)
        got = torch.tensor([c["prob"] for c in top], dtype=torch.float64)
        torch.testing.assert_close(got, p[[c["index"] for c in top]], rtol=0, atol=logit_tol / 2)
        assert (got[:-1] >= got[1:]).all()  # most probable first
        assert got.sum() <= 1 + 10 * torch.finfo(torch.float64).eps


def test_cli_json_is_the_library_result(run, digits, capsys):
    assert main(["predict", str(digits), "--checkpoint", str(run), "--json", "--top-k", "3", "--device", "cpu"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert isinstance(printed, list) and len(printed) == 8
    for entry in printed:
        assert set(entry) == {"image", "top_k"} and isinstance(entry["image"], str) and len(entry["top_k"]) == 3
        for c in entry["top_k"]:
            assert set(c) == {"label", "index", "prob"}
            assert isinstance(c["label"], str) and isinstance(c["index"], int) and isinstance(c["prob"], float)
            assert 0.0 <= c["prob"] <= 1.0
    assert printed == predict(lambdanet.load_model(run), digits, top_k=3)  # same weights, same batch: exact


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cli_predicts_in_half_precision(run, digits, capsys, dtype):
    """``--dtype``: the run's model converted to the half type (the same numbers as the library on
    ``load_model(run).to(dtype)``), close to the float64 reference within the half-precision bound."""
    half = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    argv = ["predict", str(digits), "--checkpoint", str(run), "--json", "--top-k", "10", "--device", "cpu"]
    assert main([*argv, "--dtype", dtype]) == 0
    printed = json.loads(capsys.readouterr().out)
    model = lambdanet.load_model(run)
    assert printed == predict(copy.deepcopy(model).to(half), digits, top_k=10)  # same weights, same batch: exact
    logits, probs = by_hand([r["image"] for r in printed], model)
    n_modules = sum(1 for m in model.modules() if not list(m.children()))
    logit_tol = 4 * n_modules ** 0.5 * torch.finfo(half).eps * logits.abs().max().item()  # the module docstring
    for r, p in zip(printed, probs):
        got = torch.tensor([c["prob"] for c in r["top_k"]], dtype=torch.float64)
        torch.testing.assert_close(got, p[[c["index"] for c in r["top_k"]]], rtol=0, atol=logit_tol / 2)
        assert sorted(c["index"] for c in r["top_k"]) == list(range(10))


def test_predict_runs_in_the_dtype_of_the_model(tmp_path):
    """The float32 preprocessed images are cast to the dtype of the model's parameters."""
    rng = np.random.default_rng(2)
    Image.fromarray(rng.integers(0, 256, size=(8, 8), dtype=np.uint8), mode="L").save(tmp_path / "g.png")
    cfg = {"input_size": (1, 8, 8), "mean": [0.5], "std": [0.25], "classes": None}
    reference, half = Probe(cfg, 3), Probe(cfg, 3).to(torch.bfloat16)
    predict(reference, tmp_path / "g.png")
    predict(half, tmp_path / "g.png")
    assert reference.seen[0].dtype == torch.float32 and half.seen[0].dtype == torch.bfloat16
    assert torch.equal(half.seen[0], reference.seen[0].to(torch.bfloat16))


def test_cli_table_lists_every_image_with_its_top_k(run, digits, capsys):
    files = [str(digits / "0.png"), str(digits / "more" / "7.bmp")]
    assert main(["predict", *files, "--checkpoint", str(run / "model.safetensors"), "--top-k", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    expected = predict(lambdanet.load_model(run / "model.safetensors"), files, top_k=2)
    assert len(lines) == 2 * 3
    for i, r in enumerate(expected):
        block = lines[3 * i:3 * i + 3]
        assert block[0] == r["image"]
        for rank, (line, c) in enumerate(zip(block[1:], r["top_k"]), 1):
            assert line.split() == [f"{rank}.", f"{c['prob']:.2%}", c["label"]]


def test_cli_table_columns_line_up_past_nine_ranks(run, digits, capsys):
    """At ``--top-k 10`` rank 10 is one character wider than the others: the ranks are right-aligned, so every
    line's percentage and label start where the first line's do."""
    image = str(digits / "0.png")
    assert main(["predict", image, "--checkpoint", str(run / "model.safetensors"), "--top-k", "10"]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    assert len(lines) == 10 and lines[-1].lstrip().startswith("10.")
    assert len({line.index(".") for line in lines}) == 1  # the ranks end in one column
    assert len({line.index("%") for line in lines}) == 1  # and so do the percentages (labels follow them)


class Probe(nn.Module):
    """Records its input; logits rise with the class index (``0.01 i``), so the ranking is known."""

    def __init__(self, cfg: dict, outputs: int):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(()))
        self.pretrained_cfg, self.outputs, self.seen, self.modes = cfg, outputs, [], []

    def forward(self, x):
        self.seen.append(x.clone())
        self.modes.append(self.training)
        return 0.01 * torch.arange(self.outputs, dtype=x.dtype).expand(x.shape[0], -1) + self.bias  # b classes


def test_crop_pct_bicubic_preprocessing_and_imagenet_labels(tmp_path):
    """timm's eval convention: the shorter side resized to int(image_size / crop_pct), a centre crop; and a
    1000-class model without class names gets ImageNet's."""
    rgb = np.random.default_rng(0).integers(0, 256, size=(32, 64, 3), dtype=np.uint8)  # H 32, W 64
    Image.fromarray(rgb, mode="RGB").save(tmp_path / "wide.png")
    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    probe = Probe({"input_size": (3, 8, 8), "crop_pct": 0.5, "interpolation": "bicubic", "mean": mean, "std": std,
                   "classes": None}, 1000)
    (result,) = predict(probe, tmp_path / "wide.png", top_k=5)
    # 32x64 -> shorter side 8 / 0.5 = 16: 16x32, then the central 8x8 (rows 4..11, columns 12..19)
    x = torch.from_numpy(rgb).permute(2, 0, 1)[None].double() / 255.0  # 1 3 32 64
    x = F.interpolate(x, size=(16, 32), mode="bicubic", antialias=True, align_corners=False)[..., 4:12, 12:20]
    x = (x - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    # float32 scaling, resize (weights of |sum| <= 1.25) and normalisation: a few roundings at the input's scale
    torch.testing.assert_close(probe.seen[0].double(), x, rtol=0, atol=8 * EPS32 * x.abs().max().item())
    assert [c["index"] for c in result["top_k"]] == [999, 998, 997, 996, 995]
    assert [c["label"] for c in result["top_k"]] == ["toilet tissue", "ear", "bolete", "hen-of-the-woods",
                                                     "earthstar"]  # ImageNet-1k's last five classes
    z = 0.01 * np.arange(1000)
    expected = np.exp(z[::-1][:5] - z.max()) / np.exp(z - z.max()).sum()
    # the probe's float32 logits 0.01 i (<= 10) are each off by <= eps32 / 2 * 10; p_i = exp(z_i) / sum exp(z_j)
    # then moves by at most |dz_i| + max |dz_j| relatively
    np.testing.assert_allclose([c["prob"] for c in result["top_k"]], expected, rtol=EPS32 * 10)


def test_one_channel_models_read_grayscale_and_named_classes_label_the_output(tmp_path):
    gray = np.random.default_rng(1).integers(0, 256, size=(8, 8), dtype=np.uint8)
    Image.fromarray(np.repeat(gray[..., None], 3, axis=2), mode="RGB").save(tmp_path / "g.png")  # R = G = B
    probe = Probe({"input_size": (1, 8, 8), "mean": [0.5], "std": [0.25], "classes": ["a", "b", "c"]}, 3)
    probe.train()
    (result,) = predict(probe, [tmp_path / "g.png"], top_k=10)  # more than the classes: all of them
    assert probe.modes == [False] and probe.training  # eval during the call, the training flag restored
    expected = (torch.from_numpy(gray).double() / 255.0 - 0.5) / 0.25  # luma of a gray pixel is its value
    assert probe.seen[0].shape == (1, 1, 8, 8)
    torch.testing.assert_close(probe.seen[0][0, 0].double(), expected, rtol=0, atol=4 * EPS32 * 2.0)
    assert [(c["label"], c["index"]) for c in result["top_k"]] == [("c", 2), ("b", 1), ("a", 0)]


def test_a_weights_file_of_another_class_count_brings_its_classifier_never_a_random_one(tmp_path, capsys):
    """``--model NAME --checkpoint FILE`` of a 3-class model: the model is built with the file's 3 classes (it was
    built with the default 1000 and the file's classifier left out, so the predictions came from a random one); a
    ``num_classes`` that contradicts the file is refused, 0 (the features) is what it asks."""
    from lambdanet.predict import load_for_inference

    trained = lambdanet.create_model("resnet26", num_classes=3).eval()
    torch.save(trained.state_dict(), tmp_path / "three.pth")
    loaded = load_for_inference(tmp_path / "three.pth", model="resnet26")
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(loaded(x), trained(x))  # the same weights, the same ops
    assert loaded.pretrained_cfg["num_classes"] == 3 and loaded.pretrained_cfg["load_notes"] == []
    with torch.no_grad():
        assert load_for_inference(tmp_path / "three.pth", model="resnet26", num_classes=0)(x).shape == (2, 2048)
    argv = ["export", "--model", "resnet26", "--checkpoint", str(tmp_path / "three.pth"), "--num-classes", "5",
            "--format", "torchscript", "--out", str(tmp_path / "m.pt")]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "num_classes=5 does not match checkpoint" in err and "has 3 classes" in err
    assert not (tmp_path / "m.pt").exists()
    odd = dict(trained.state_dict(), **{"fc.weight": torch.randn(3, 1024)})  # a classifier of another feature width
    torch.save(odd, tmp_path / "odd.pth")
    with pytest.raises(ValueError, match=r"3-class classifier does not fit 'resnet26' \(another feature width\)"):
        load_for_inference(tmp_path / "odd.pth", model="resnet26")


def test_a_model_built_at_another_img_size_is_fed_images_of_that_size(run, tmp_path):
    """``create_model(name, img_size=...)`` (with or without a run's weights) says the size it was built for in
    ``pretrained_cfg``, which ``predict`` resizes to: it said the family's default (224) or the run's (16)."""
    Image.new("L", (40, 30)).save(tmp_path / "g.png")
    models = [lambdanet.create_model("resnet26", in_chans=1, num_classes=3, base_width=4, img_size=32),
              lambdanet.create_model("lambda_resnet26", checkpoint_path=run, in_chans=1, num_classes=10,
                                     **lambdanet.load_model(run).model_kwargs | {"img_size": 32})]  # fmt: skip
    for model in models:
        seen = []
        model.register_forward_pre_hook(lambda module, args: seen.append(tuple(args[0].shape)))
        predict(model, tmp_path / "g.png")
        assert model.pretrained_cfg["input_size"] == (1, 32, 32) and seen == [(1, 1, 32, 32)]


def test_find_images_expands_folders_and_rejects_what_is_not_there(digits, tmp_path):
    found = find_images([digits / "3.png", digits / "more"])
    assert found == [digits / "3.png", digits / "more" / "6.PNG", digits / "more" / "7.bmp"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no image files"):
        find_images(tmp_path / "empty")
    with pytest.raises(ValueError, match="does not exist"):
        find_images(tmp_path / "missing.png")
    with pytest.raises(ValueError, match="no pretrained_cfg"):
        predict(nn.Linear(2, 2), digits)


@pytest.mark.parametrize("argv,needle", [
    (["BAD", "--checkpoint", "RUN"], "is not a readable image"),
    (["MISSING", "--checkpoint", "RUN"], "does not exist"),
    (["IMG"], "give the weights: --checkpoint PATH"),
    (["IMG", "--model", "lambda_resnet26", "--pretrained", "--checkpoint", "RUN"], "exclude each other"),
    (["IMG", "--pretrained"], "--pretrained needs --model NAME"),
    (["IMG", "--model", "resnet26", "--checkpoint", "RUN"], "does not match checkpoint"),
    (["IMG", "--model", "resnet26", "--pretrained"], "pretrained"),  # no weights published: no download tried
    (["IMG", "--checkpoint", "RUN", "--top-k", "0"], "--top-k must be a positive int, got 0"),
    (["IMG", "--checkpoint", "RUN", "--dtype", "half"],
     "--dtype must be one of ['float32', 'float16', 'bfloat16'], got 'half'"),
])
def test_predict_user_errors_are_one_line_and_exit_2(run, tmp_path, capsys, argv, needle):
    bad, good = tmp_path / "not_an_image.png", tmp_path / "image.png"
    bad.write_text("hello")
    Image.new("L", (8, 8)).save(good)
    subst = {"BAD": str(bad), "IMG": str(good), "RUN": str(run), "MISSING": str(tmp_path / "missing.jpg")}
    assert main(["predict", *[subst.get(a, a) for a in argv]]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith("lambdanet predict: error: ") and needle in captured.err
    if argv[0] == "BAD":
        assert str(bad) in captured.err  # names the file
