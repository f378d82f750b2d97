"""The light core install: what works without the extras, and the one-line message when an extra is missing.

The extras' packages are made unimportable (``sys.modules[name] = None``, as pip leaves them when the extra was
not installed); .ci/run checks the real thing, the wheel in a fresh environment (.ci/core_smoke.py).
"""

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from lambdanet.cli import main

REPO = Path(__file__).resolve().parent.parent
EXTRA_MODULES = ("matplotlib", "sklearn", "mlxtend", "tensorboard", "pycocotools", "onnx", "onnxruntime",
                 "onnxscript", "timm", "lambda_networks")


def test_the_core_dependencies_are_timms_core_set():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    core = {d.split(">")[0].split("=")[0].strip().lower() for d in project["dependencies"]}
    assert core == {"torch", "torchvision", "numpy", "pyyaml", "safetensors", "tqdm", "huggingface_hub"}
    assert set(project["optional-dependencies"]) == {"train", "detect", "export", "bench", "dev"}


def test_the_library_core_runs_with_no_extra_importable():
    code = f"""
import sys
for name in {EXTRA_MODULES!r}:
    sys.modules[name] = None  # import raises ImportError
import tempfile, numpy as np, torch
from pathlib import Path
from PIL import Image
import lambdanet
from lambdanet import LambdaLayer, create_model, load_model
from lambdanet.predict import predict
assert LambdaLayer(16, dim_k=8, r=5)(torch.randn(1, 16, 6, 6)).shape == (1, 16, 6, 6)
assert create_model("lambda_resnet26", num_classes=3).eval()(torch.randn(1, 3, 32, 32)).shape == (1, 3)
run = load_model({str(REPO / "tests" / "fixtures" / "runs_v1" / "train_done")!r})
with tempfile.TemporaryDirectory() as tmp:
    Image.fromarray(np.zeros((9, 9), dtype=np.uint8), mode="L").save(Path(tmp) / "x.png")
    print(len(predict(run, Path(tmp) / "x.png", top_k=3)[0]["top_k"]))
loaded = sorted(name for name in {EXTRA_MODULES!r} if sys.modules.get(name) is not None)
print(loaded)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["3", "[]"]


@pytest.mark.parametrize("missing,argv,extra", [
    ("matplotlib", ["train", "--data", "digits", "--epochs", "1"], "train"),
    ("tensorboard", ["train", "--data", "digits", "--epochs", "1"], "train"),
    ("sklearn", ["train", "--data", "digits", "--epochs", "1", "--no-tensorboard"], "train"),
    ("pycocotools", ["detect", "--epochs", "1"], "detect"),
    ("matplotlib", ["lm", "train", "--model", "lambda_lm_nano"], "train"),
])
def test_a_command_missing_its_extra_names_it_in_one_line(missing, argv, extra, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, missing, None)
    if missing == "sklearn":
        monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
        from lambdanet.tasks.classification import datasets as data

        data._digits.cache_clear()
    assert main(argv + ["--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f'pip install "lambdanet[{extra}]"' in err and missing in err, err
    if missing == "tensorboard":
        assert "--no-tensorboard" in err
    assert not (tmp_path / "run" / "last.pt").exists()


def test_importing_the_package_or_the_command_line_loads_no_compiler():
    """``import lambdanet`` and the command line's parser (every command's start, ``--help`` included) leave
    ``torch._dynamo`` unloaded: torch's ``assume_constant_result`` decorator imported it at import time, 2.5 of
    the 5.5 s ``import lambdanet`` took on 2 CPU cores."""
    code = ("import sys\nimport lambdanet\nfrom lambdanet.cli import build_parser\nbuild_parser()\n"
            "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo') or m.startswith('torch._inductor')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", (proc.stdout[-500:], proc.stderr[-2000:])


def test_the_constant_mark_is_torchs_own(monkeypatch):
    """:func:`lambdanet.helpers.assume_constant_result` sets what torch's decorator sets, and only that (a torch
    release that marks another way fails here, and the compile tests' graph breaks say where)."""
    import torch

    from lambdanet.helpers import assume_constant_result

    def ours():
        return 0

    def theirs():
        return 0

    import torch._dynamo

    before = dict(ours.__dict__)
    with monkeypatch.context() as m:
        m.delitem(sys.modules, "torch._dynamo")  # as in a process that compiles nothing
        assume_constant_result(ours)
    torch._dynamo.assume_constant_result(theirs)
    assert ours.__dict__ == theirs.__dict__ != before
