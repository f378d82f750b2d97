"""The core install alone (no extras), run by .ci/run in a fresh environment holding only the built wheel.

Checks that none of the extras' packages is present, that the library's core works (a lambda layer, a model,
loading a run's weights, predict, the timm-keyed pretrained_cfg) and that a command needing an extra says in one
line which one to install. Exits non-zero on the first failure.
"""

import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image

import lambdanet
from lambdanet import LambdaLayer, create_model, load_model
from lambdanet.predict import predict

ROOT = Path(__file__).resolve().parent.parent
EXTRAS_ONLY = ("matplotlib", "sklearn", "mlxtend", "tensorboard", "pycocotools", "onnx", "onnxruntime", "timm",
               "lambda_networks", "pytest")

present = [m for m in EXTRAS_ONLY if importlib.util.find_spec(m) is not None]
assert not present, f"the core install pulled in {present}"
assert Path(lambdanet.__file__).resolve().is_relative_to(Path(sys.prefix).resolve()), "not the installed wheel"

torch.manual_seed(0)
layer = LambdaLayer(dim=16, dim_out=16, heads=4, dim_k=8, r=5)
assert layer(torch.randn(2, 16, 6, 6)).shape == (2, 16, 6, 6)
model = create_model("lambda_resnet26", num_classes=3).eval()
assert model.pretrained_cfg["input_size"] == (3, 224, 224)
with torch.no_grad():
    assert model(torch.randn(1, 3, 64, 64)).shape == (1, 3)

run = load_model(ROOT / "tests" / "fixtures" / "runs_v1" / "train_done")  # weights written by lambdanet 0.1.0
with tempfile.TemporaryDirectory() as tmp:
    image = Path(tmp) / "x.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (20, 20), dtype=np.uint8), mode="L").save(image)
    (result,) = predict(run, image, top_k=2)
    first, second = result["top_k"]
    assert 1.0 >= first["prob"] >= second["prob"] >= 0.0, result

cli = [sys.executable, "-m", "lambdanet"]
version = subprocess.run(cli + ["--version"], capture_output=True, text=True, check=True).stdout.strip()
assert version == f"lambdanet {lambdanet.__version__}", version
with tempfile.TemporaryDirectory() as tmp:
    proc = subprocess.run(cli + ["train", "--data", "digits", "--out", tmp], capture_output=True, text=True)
assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and 'lambdanet[train]' in proc.stderr, proc.stderr
print(f"core install OK: lambdanet {lambdanet.__version__}, torch {torch.__version__}; {proc.stderr.strip()}")
