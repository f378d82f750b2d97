"""The command-line flags of a run configuration, generated from its fields (:mod:`lambdanet.engine.config`): one
``--flag`` per field with its help, choices and the default the recipes give it, ``--config FILE`` and
``--threads N``. (What the parsed flags ask for is :func:`lambdanet.engine.config.config_source_from_args`.)"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any

import yaml

from lambdanet.engine.values import read_yaml

__all__ = [
    "flag",
    "add_config_arguments",
    "add_threads_argument",
    "describe_default",
    "THREADS_HELP",
]


def flag(name: str) -> str:
    """``--flag`` spelling of a configuration field."""
    return "--" + name.replace("_", "-")


def _parse_mapping(text: str) -> dict:
    """``'{stage_layers: LLLL, layer_kwargs: {r: 7}}'`` or ``'stage_layers=LLLL,base_width=16'`` (a value may be a
    YAML list or mapping: ``anchor_sizes=[16, 32]``; ``None`` as ``null``); anything else is argparse's one-line
    usage error."""
    expected = f"expected a mapping like 'key=value,...' or '{{key: value}}', got {text!r}"
    try:
        if "=" in text and not text.strip().startswith("{"):
            parts = [part.partition("=") for part in _top_level_items(text)]
            if any(not sep or not key.strip() for key, sep, _ in parts):
                raise argparse.ArgumentTypeError(f"{expected} (each item key=value)")
            # Python's None reads as YAML's null there (YAML reads True / False alike already)
            return {key.strip(): None if value.strip() == "None" else read_yaml(value) for key, _, value in parts}
        value = read_yaml(text)
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or "not valid YAML"
        raise argparse.ArgumentTypeError(
            f"{expected}: {problem} (a list or mapping value needs its brackets closed, e.g. "
            "'{anchor_sizes: [16, 32, 64, 128, 256]}')"
        ) from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(expected)
    return {k: None if v == "None" else v for k, v in value.items()}  # Python's None as null here too


def _top_level_items(text: str) -> list[str]:
    """``text`` split at the commas outside brackets and braces (``a=[1,2],b=3`` -> ``a=[1,2]``, ``b=3``)."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += (char in "[{") - (char in "]}")
        if char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    return [*items, text[start:]]


GIVEN = "_flags_given"  # the Namespace attribute listing the options given on the command line (null ones too)


def _recording(action: type[argparse.Action]) -> type[argparse.Action]:
    """``action`` that also adds its option to the namespace's :data:`GIVEN` set: a flag given as ``null`` parses to
    ``None``, which is also every flag's "not given" default; this tells them apart."""

    class Recorded(action):  # type: ignore[valid-type,misc]
        def __call__(self, parser, namespace, values, option_string=None):
            super().__call__(parser, namespace, values, option_string)
            given = getattr(namespace, GIVEN, None)
            if given is None:
                given = set()
                setattr(namespace, GIVEN, given)
            given.add(self.dest)

    return Recorded


_STORE, _BOOLEAN = _recording(argparse._StoreAction), _recording(argparse.BooleanOptionalAction)


def given_flags(args: argparse.Namespace) -> set[str]:
    """The destinations of the configuration flags given on the command line (``--ema-decay null`` included)."""
    return set(getattr(args, GIVEN, None) or ())


def _optional(conv):
    def parse(text: str):
        return None if text.lower() in ("none", "null") else conv(text)

    parse.__name__ = getattr(conv, "__name__", "value")
    return parse


def _shown(value) -> str:
    return "null" if value is None else str(value)


def describe_default(name: str, values: dict[str, dict], default_recipe: str = "quick") -> str:
    """``default: X`` when every recipe runs ``name`` with the same value, else the default recipe's value and
    each other recipe's (``default: 1200 (quick recipe); paper: 0``), so ``--help`` shows what will run."""
    first = _shown(values[default_recipe][name])
    others = [
        f"{recipe}: {_shown(v[name])}"
        for recipe, v in values.items()
        if recipe != default_recipe and _shown(v[name]) != first
    ]
    if name == "recipe" or not others:
        return f"default: {first}"
    return f"default: {first} ({default_recipe} recipe); " + "; ".join(others)


def add_config_arguments(parser: argparse.ArgumentParser, config_cls: Any) -> None:
    """``--config FILE`` (YAML) and one ``--flag`` per field of ``config_cls`` (a
    :class:`~lambdanet.engine.config.RunConfig` subclass) with its one-line help
    (:func:`~lambdanet.engine.config.option` metadata), choices and default as the recipes set it
    (:func:`describe_default`; booleans: ``--flag`` / ``--no-flag``); the parsed default is ``None`` = "not
    given", so recipe and YAML values survive (:func:`~lambdanet.engine.config.config_source_from_args` reads
    them back); and ``--threads N`` (:func:`add_threads_argument`)."""
    parser.add_argument("--config", help="YAML file of options")
    hints = typing.get_type_hints(config_cls)
    choices, recipes = config_cls.choices(), config_cls.recipe_table()
    for f in dataclasses.fields(config_cls):
        hint = hints[f.name]
        args = typing.get_args(hint)
        base = next((a for a in args if a is not type(None)), hint) if args else hint
        help_text = f"{f.metadata['help']} ({describe_default(f.name, recipes)})"
        kind: dict[str, Any]
        if base is bool:
            kind = {"action": _BOOLEAN}
        elif base is dict or hint is dict:
            kind = {"action": _STORE, "type": _parse_mapping, "metavar": "MAPPING"}
        elif base is list or hint is list:
            kind = {"action": _STORE, "type": float, "nargs": "+", "metavar": "X"}
        else:
            conv = {int: int, float: float, str: str}.get(base, str)
            kind = {
                "action": _STORE,
                "type": _optional(conv) if type(None) in args else conv,
                "choices": choices.get(f.name),
                "metavar": "{" + ",".join(choices[f.name]) + "}" if f.name in choices else None,
            }
        parser.add_argument(flag(f.name), dest=f.name, default=None, help=help_text, **kind)
    if "threads" not in hints:
        add_threads_argument(parser)


THREADS_HELP = (
    "CPU threads of this process (torch.set_num_threads); on a busy machine fewer than the cores can be "
    "several times faster (default: PyTorch's choice, one per core)"
)


def add_threads_argument(parser: argparse.ArgumentParser, help: str = THREADS_HELP) -> None:
    """``--threads N`` (``args.threads``, ``None`` when not given): the CPU threads the command runs with, a
    setting of the process, not of the run (not saved, free to change on ``--resume``); ``lambdanet.cli.main``
    applies it with :func:`lambdanet.runtime.intra_op_threads`."""
    parser.add_argument("--threads", type=int, default=None, metavar="N", help=help)
