"""What the tests of the moved task modules share (issue 38): forgetting the old import paths, so that their shims
run (and warn) again as in a fresh interpreter, and checking that an old path is the new module itself."""

import importlib
import re
import sys

import pytest


def forget_old_paths(monkeypatch, *packages: str) -> None:
    """Drop ``packages`` and their submodules from ``sys.modules`` for one test."""
    for name in [n for n in sys.modules if any(n == p or n.startswith(p + ".") for p in packages)]:
        monkeypatch.delitem(sys.modules, name)


def assert_moved(old: str, new: str, monkeypatch, package: str, new_package: str) -> None:
    """Importing ``old`` afresh warns that it moved to ``new`` (its old package, imported first, that the package
    moved) and gives the new module: the same object under both names, every public name the same object."""
    forget_old_paths(monkeypatch, package)
    if old.startswith(package + "."):
        with pytest.warns(DeprecationWarning, match=re.escape(f"{package} moved to {new_package};")):
            importlib.import_module(package)
    with pytest.warns(DeprecationWarning, match=re.escape(f"{old} moved to {new}")):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new) and sys.modules[old] is module
    assert module.__all__ and all(getattr(module, name) is getattr(sys.modules[new], name) for name in module.__all__)
