"""The classification task moved to lambdanet/tasks/classification/ (issue 38): for one release its old import paths
(lambdanet.train, its modules, lambdanet.data) still import, warn with a DeprecationWarning naming the new path and
give the new modules' very objects."""

import re

import pytest

import lambdanet.tasks.classification as classification
from lambdanet.tasks.classification import config, data, task
from moved_paths import assert_moved, forget_old_paths

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
    forget_old_paths(monkeypatch, "lambdanet.data", "lambdanet.train")


@pytest.mark.parametrize("old, new", MOVED.items())
def test_classification_old_paths_warn_and_alias(old, new, monkeypatch):
    forget_old_paths(monkeypatch, "lambdanet.data")
    assert_moved(old, new, monkeypatch, "lambdanet.train", "lambdanet.tasks.classification")


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
