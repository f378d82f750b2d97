"""Option values of the run configurations (:mod:`lambdanet.engine.config`): the checks of their types and
ranges, whose one-line ``ValueError`` names the option and what it must be (``lambdanet.cli.main`` prints it
with exit status 2), and the YAML files they are read from (``--config FILE``, a run's ``config.yaml``) and
written to."""

from __future__ import annotations

import dataclasses
import os
import re
import typing
from pathlib import Path

import yaml

from lambdanet.files import check_path_given
from lambdanet.helpers import check_number

__all__ = ["check_number", "check_types", "load_yaml", "load_run_yaml", "save_yaml", "read_yaml"]


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader (YAML 1.1), which also reads ``1e-3`` and ``5E+2`` as floats, as Python does (1.1 wants
    a dot: ``1.0e-3``; ``lr: 1e-3`` in a file written by hand was the string ``'1e-3'``, refused as not a number)."""


class _Dumper(yaml.SafeDumper):
    """PyYAML's safe dumper, which quotes a string that :class:`_Loader` would read as a float (``out: '1e-3'``)."""


_EXPONENT = re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")
for _kind in (_Loader, _Dumper):
    _kind.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT, list("-+0123456789"))


def read_yaml(text: str):
    """The value a YAML text holds (safe: plain data only), ``1e-3`` a float (:class:`_Loader`)."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506  (a SafeLoader)


# the annotations check_types checks (numbers are left to the ranges each configuration checks)
_KINDS: dict[type, tuple[tuple[type, ...], str]] = {
    bool: ((bool,), "true or false"),
    str: ((str, os.PathLike), "a string"),  # a path too, as the Python API has always taken (out=Path(...))
    dict: ((dict,), "a mapping (key: value)"),
    list: ((list, tuple), "a list"),
}


def check_types(cls: type, values: dict) -> None:
    """A one-line ``ValueError`` for a value in ``values`` (options of the configuration dataclass ``cls``: a
    ``--config`` file, a run's ``config.yaml``, overrides) whose type is not its field's: a string, true or
    false, a mapping or a list (``null`` where the field may be null), and any int within 64 bits. Numbers are
    checked with their ranges (:meth:`RunConfig.check_int`, :func:`check_number`)."""
    hints = typing.get_type_hints(cls)
    for name, value in values.items():
        hint = hints.get(name)
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            continue
        base = next((a for a in args if a is not type(None)), hint) if args else hint
        base = typing.get_origin(base) or base
        if base in _KINDS and not isinstance(value, _KINDS[base][0]):
            raise ValueError(f"{name} must be {_KINDS[base][1]}, got {value!r}")
        if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**63:
            raise ValueError(f"{name} must be a 64-bit int (below 2**63: torch's sizes and counts), got {value}")


def load_yaml(path: str | Path, what: str = "config file", *, written: bool = False) -> dict:
    """The mapping of option: value a YAML file holds (an empty file: none); a one-line ``ValueError`` naming
    the file (``what``: how to call it) when it is missing, a folder, not text, not valid YAML or not a
    mapping. ``written``: a file lambdanet wrote (a run's ``config.yaml``), read as PyYAML wrote it (YAML 1.1: an
    earlier version left a string ``1e-3`` unquoted); a file written by hand reads ``1e-3`` as a number."""
    check_path_given(path, f"the {what} path", "give a YAML file of option: value")
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{what} {path} is a directory, not a YAML file of option: value")
    if not path.is_file():
        raise ValueError(f"{what} {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
        data = (yaml.safe_load(text) if written else read_yaml(text)) or {}
    except UnicodeDecodeError:
        raise ValueError(f"{what} {path} is not a text file (not UTF-8); expected YAML of option: value") from None
    except yaml.YAMLError as err:
        raise ValueError(f"{what} {path} is not valid YAML ({_yaml_problem(err)})") from None
    except OSError as err:
        raise ValueError(f"{what} {path} cannot be read ({err.strerror or err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what} {path} must hold a mapping of option: value, got {type(data).__name__}")
    return data


def _yaml_problem(err: yaml.YAMLError) -> str:
    """``line 2, column 1: expected ',' or ']'`` for a YAML syntax error."""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return f"{where}{problem}"


def load_run_yaml(path: str | Path) -> dict:
    """A run's ``config.yaml``, which ``--resume`` continues the run with: :func:`load_yaml`, and a one-line
    ``ValueError`` for an empty one (a file emptied or truncated outside lambdanet), which would otherwise
    resume under the defaults."""
    data = load_yaml(path, "the run's configuration", written=True)
    if not data:
        raise ValueError(
            f"{path} is empty, so the run cannot be resumed with its configuration; restore it (from a copy "
            "of the run), or start a new run with another --out"
        )
    return data


def save_yaml(cfg, path: str | Path) -> None:
    """The configuration ``cfg`` (a dataclass) as YAML, written to ``<path>.tmp`` and renamed over ``path``: a
    crash leaves the previous file or the new one, never a truncated one."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(yaml.dump(dataclasses.asdict(cfg), Dumper=_Dumper, sort_keys=False))
    os.replace(tmp, path)
