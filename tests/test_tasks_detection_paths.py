"""The detection task moved to lambdanet/tasks/detection/ (issue 38): for one release its old import paths
(lambdanet.detection and its modules) still import, warn with a DeprecationWarning naming the new path and give
the new modules' very objects."""

import re
import sys

import pytest

import lambdanet.tasks.detection as detection
from lambdanet.tasks.detection import config, glyphs, pretrain, task
from moved_paths import assert_moved, forget_old_paths

MOVED = {
    "lambdanet.detection.trainer": "lambdanet.tasks.detection.task",
    **{
        f"lambdanet.detection.{name}": f"lambdanet.tasks.detection.{name}"
        for name in ("coco", "data", "evaluate", "glyphs", "model", "pretrain", "study", "targets")
    },
}


def _forget_old_paths(monkeypatch) -> None:
    forget_old_paths(monkeypatch, "lambdanet.detection")


@pytest.mark.parametrize("old, new", MOVED.items())
def test_detection_old_paths_warn_and_alias(old, new, monkeypatch):
    assert_moved(old, new, monkeypatch, "lambdanet.detection", "lambdanet.tasks.detection")


def test_detection_old_objects_are_the_new_ones(monkeypatch):
    _forget_old_paths(monkeypatch)
    with pytest.warns(DeprecationWarning, match=re.escape("lambdanet.detection moved to lambdanet.tasks.detection")):
        import lambdanet.detection as old_package
    assert old_package.__all__ == detection.__all__
    assert all(getattr(old_package, name) is getattr(detection, name) for name in detection.__all__)
    with pytest.warns(DeprecationWarning, match="lambdanet.tasks.detection"):
        from lambdanet.detection.pretrain import upgrade_detection_checkpoint
        from lambdanet.detection.trainer import (
            DETECT_RECIPES,
            QUICK_PRETRAIN_STEPS,
            DetectConfig,
            DetectionTask,
            _pretrain,
            build_detector,
            recipe_values,
            resolve_detect_config,
            train_detector,
        )
    # the names lambdanet.detection.trainer had, wherever they live now (config.py for the configuration)
    assert DetectConfig is config.DetectConfig and DETECT_RECIPES is config.DETECT_RECIPES
    assert resolve_detect_config is config.resolve_detect_config and recipe_values is config.recipe_values
    assert QUICK_PRETRAIN_STEPS == config.QUICK_PRETRAIN_STEPS
    assert train_detector is task.train_detector and DetectionTask is task.DetectionTask
    assert build_detector is task.build_detector and _pretrain is task._pretrain  # private names too
    assert upgrade_detection_checkpoint is pretrain.upgrade_detection_checkpoint
    from lambdanet.detection import glyphs as old_glyphs, trainer  # the forms tests and scripts of earlier releases use

    assert trainer is task and old_glyphs is glyphs
    assert old_glyphs.GlyphPool is glyphs.GlyphPool  # the rendering moved to glyph_render.py, still importable here


def test_the_old_packages_keep_their_renamed_submodules_and_run_as_scripts(tmp_path):
    """``lambdanet.train.trainer``, ``lambdanet.lm.corpus`` and ``lambdanet.detection.trainer`` stay attributes of
    their old packages (the new modules under their old names), and ``python -m`` of an old path runs the new
    module (it did nothing and exited 0 when the alias replaced ``__main__``)."""
    import subprocess

    code = ("import warnings; warnings.simplefilter('ignore')\n"
            "import lambdanet.train as t, lambdanet.lm as l, lambdanet.detection as d\n"
            "import lambdanet.tasks.classification.task as ct, lambdanet.tasks.lm.data as ld\n"
            "import lambdanet.tasks.detection.task as dt\n"
            "assert t.trainer is ct and l.corpus is ld and d.trainer is dt\n")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0
    run = subprocess.run([sys.executable, "-m", "lambdanet.detection.study", str(tmp_path / "none")],
                         capture_output=True, text=True)
    assert run.returncode == 2 and "summary.json" in run.stderr and run.stderr.count("\n") == 1, run.stderr
