"""The classification task moved to lambdanet/tasks/classification/ (issue 38): for one release its old import paths
(lambdanet.train, its modules, lambdanet.data) still import, warn with a DeprecationWarning naming the new path and
give the new modules' very objects."""

import importlib
import re
import sys

import pytest

import lambdanet.tasks.classification as classification
from lambdanet.tasks.classification import config, data, task

MOVED = {
    "lambdanet.train.config": "lambdanet.tasks.classification.config",
    "lambdanet.train.trainer": "lambdanet.tasks.classification.task",
    "lambdanet.train.load": "lambdanet.tasks.classification.load",
    "lambdanet.train.metrics": "lambdanet.tasks.classification.metrics",
    "lambdanet.train.mix": "lambdanet.tasks.classification.mix",
    "lambdanet.train.pseudo": "lambdanet.tasks.classification.pseudo",
    "lambdanet.train.sweep": "lambdanet.tasks.classification.sweep",
    "lambdanet.data": "lambdanet.tasks.classification.data",
}


def _forget_old_paths(monkeypatch) -> None:
    """A fresh interpreter's state for the old paths: imported again, their shims run (and warn) again."""
    old = [n for n in sys.modules if n in ("lambdanet.data", "lambdanet.train") or n.startswith("lambdanet.train.")]
    for name in old:
        monkeypatch.delitem(sys.modules, name)


@pytest.mark.parametrize("old, new", MOVED.items())
def test_classification_old_paths_warn_and_alias(old, new, monkeypatch):
    _forget_old_paths(monkeypatch)
    if old.startswith("lambdanet.train."):  # the old package first, which warns of its own move
        with pytest.warns(DeprecationWarning, match="lambdanet.train moved to lambdanet.tasks.classification;"):
            importlib.import_module("lambdanet.train")
    with pytest.warns(DeprecationWarning, match=re.escape(f"{old} moved to {new}")):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new) and sys.modules[old] is module
    assert module.__all__ and all(getattr(module, name) is getattr(sys.modules[new], name) for name in module.__all__)


def test_classification_old_objects_are_the_new_ones(monkeypatch):
    _forget_old_paths(monkeypatch)
    with pytest.warns(DeprecationWarning, match=re.escape("lambdanet.train moved to lambdanet.tasks.classification")):
        import lambdanet.train as old_package
    with pytest.warns(DeprecationWarning, match="lambdanet.tasks.classification"):
        from lambdanet.data import ImageLoader
        from lambdanet.train.config import TrainConfig
        from lambdanet.train.trainer import ClassificationTask, _dry_run
    assert TrainConfig is config.TrainConfig and ClassificationTask is task.ClassificationTask
    assert ImageLoader is data.ImageLoader and _dry_run is task._dry_run  # private names too
    assert old_package.__all__ == classification.__all__
    assert all(getattr(old_package, name) is getattr(classification, name) for name in classification.__all__)
    from lambdanet.train import trainer  # the form tests and scripts of earlier releases use

    assert trainer is task
