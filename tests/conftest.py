import contextlib
import os

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook


# LambdaLayer(impl="auto") follows its static cost model here (and in the CLI runs the tests start): no timing of
# the implementations on first calls; the tests of the measuring tuner switch it on themselves
os.environ.setdefault("LAMBDANET_AUTOTUNE", "0")

# without a GPU the Triton kernels (lambdanet.ops) run on CPU tensors in Triton's interpreter; the variable
# must be set before the kernels are first imported (triton.jit reads it when it decorates them)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from lambdanet.engine.distributed import threads_per_process, usable_cores  # noqa: E402  (after the variables)


def pytest_xdist_auto_num_workers(config):
    """pytest-xdist's ``-n auto`` (pyproject's addopts): one worker per core this process may use, at most 8; none
    (one process) for the accelerator tests (``-m device``): they share one device."""
    return 0 if "device" in (config.option.markexpr or "") else max(1, min(8, usable_cores()))


# keep the default suite deterministic and quick on 2 cores: OMP_NUM_THREADS where set; else the cores shared among
# pytest-xdist's workers, at most 2, as the suite always ran. Test processes that share the cores (xdist's workers,
# and the CLI runs they start, which inherit OMP_NUM_THREADS) take one thread each: OpenMP's threads on a core
# another process holds wait on each other, and every step gets many times slower
THREADS = int(os.environ.get("OMP_NUM_THREADS") or 0) or min(
    2, threads_per_process(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1))
)
torch.set_num_threads(THREADS)
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def image_folder(tmp_path_factory):
    """An ImageNet-style tree (``train/`` and ``val/``) of two classes, cats and dogs, 6 RGB 20x24 images each;
    the classes differ in brightness so a model can learn them. Tests only read it."""
    from PIL import Image

    root = tmp_path_factory.mktemp("image_folder") / "imgs"
    g = torch.Generator().manual_seed(0)
    for split in ("train", "val"):
        for c, cls in enumerate(("cats", "dogs")):
            (root / split / cls).mkdir(parents=True)
            for i in range(6):
                img = (torch.rand(20, 24, 3, generator=g) * 120 + 100 * c).to(torch.uint8)
                Image.fromarray(img.numpy()).save(root / split / cls / f"{i}.png")
    return root


@pytest.fixture(scope="session")
def tiny_digits_run(tmp_path_factory):
    """A digits run (lambda_resnet26 with the small-image stem, 1 channel, 16x16, classes unnamed) trained for
    two steps; tests only read it."""
    from lambdanet.tasks.classification import resolve_config, train

    out = tmp_path_factory.mktemp("tiny_digits") / "run"
    train(resolve_config(overrides={"epochs": 1, "max_train_batches": 2, "batch_size": 32, "progress": False,
                                    "tensorboard": False, "out": str(out)}))
    return out


@pytest.fixture
def power_cut():
    """``with power_cut(n):`` a process dying without warning: ``RuntimeError("power cut")`` raised right after
    the n-th optimiser step (of any task) from then on, before the run can save anything after it."""

    @contextlib.contextmanager
    def cut(after_step: int):
        count = [0]

        def hook(optimizer, args, kwargs):
            count[0] += 1
            if count[0] == after_step:
                raise RuntimeError("power cut")

        handle = register_optimizer_step_post_hook(hook)
        try:
            yield
        finally:
            handle.remove()

    return cut


@pytest.fixture
def reverse_grid(monkeypatch):
    """``reverse_grid()``: from then on Triton's interpreter runs each launch's programs in the reverse of grid
    order (every axis). The interpreter runs them one after another, so a kernel whose programs read what other
    programs of the same launch write, or write the same elements, works in grid order; on a GPU they run at the
    same time (a race). Reversed, such a kernel gives other results. Skips where the kernels are compiled."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the program order is the interpreter's (TRITON_INTERPRET=1)")
    from triton.runtime.interpreter import interpreter_builder as builder

    set_index = builder.set_grid_idx

    def reverse() -> None:
        def mirrored(*index: int) -> None:
            set_index(*(size - 1 - i for size, i in zip(builder.grid_dim, index)))

        monkeypatch.setattr(builder, "set_grid_idx", mirrored)

    return reverse
