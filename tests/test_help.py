"""``--help`` shows, for every option a recipe sets, the value each recipe runs with (not the dataclass default
that the recipe replaces)."""

import dataclasses

import pytest

from lambdanet.cli import build_parser
from lambdanet.tasks.classification.config import RECIPE_MODEL_KEYS, RECIPES, TrainConfig


def option_help(command: str) -> dict[str, str]:
    parser = build_parser().commands[command]
    return {a.dest: " ".join(a.help.split()) for a in parser._actions if a.help and a.dest != "help"}


def shown(value) -> str:
    return "null" if value is None else str(value)


@pytest.mark.parametrize("recipe", ["quick", "paper"])
def test_detect_help_shows_what_each_recipe_resolves_to(recipe):
    pytest.importorskip("pycocotools")
    from lambdanet.tasks.detection.config import DetectConfig, recipe_values, resolve_detect_config

    resolved = dataclasses.asdict(resolve_detect_config(recipe))
    assert recipe_values()[recipe] == resolved  # the values --help shows are those a run resolves to
    helps = option_help("detect")
    for name, value in resolved.items():
        if name == "recipe":
            continue
        text = helps[name]
        expect = f"default: {shown(value)}" if recipe == "quick" else f"paper: {shown(value)}"
        if recipe == "paper" and shown(value) == shown(recipe_values()["quick"][name]):
            expect = f"default: {shown(value)}"  # the same in both: shown once
        assert expect in text, (name, text)
    if recipe == "quick":  # the case a user met: 0 was shown while the quick recipe pre-trains
        assert resolved["pretrain_steps"] > 0 and "default: 0" not in helps["pretrain_steps"]
        assert DetectConfig().pretrain_steps == 0


def test_train_help_shows_each_recipes_value():
    helps = option_help("train")
    defaults = dataclasses.asdict(TrainConfig())
    for recipe, values in RECIPES.items():
        for name, value in values.items():
            if shown(value) != shown(defaults[name]):
                assert f"{recipe}: {shown(value)}" in helps[name], (recipe, name, helps[name])
        for name in RECIPE_MODEL_KEYS.get(recipe, ()):
            assert f"{recipe}: the model's" in helps[name], (recipe, name)
    assert helps["lr"].startswith(TrainConfig.__dataclass_fields__["lr"].metadata["help"])
    assert f"default: {TrainConfig.lr} (quick recipe)" in helps["lr"]


@pytest.mark.parametrize(
    "command", ["train", "sweep", "eval", "predict", "detect", "lm train", "lm sample", "pseudo-label", "bench"]
)
def test_the_commands_that_compute_take_threads(command):
    """--threads N (issue 40): on the training commands and on eval, predict and lm sample, documented."""
    import argparse

    parser = build_parser().commands[command.split()[0]]
    for name in command.split()[1:]:  # lm's own commands
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    action = next((a for a in parser._actions if "--threads" in a.option_strings), None)
    assert action is not None and action.type is int and action.default is None, command
    assert "torch.set_num_threads" in action.help and "default: PyTorch's choice" in action.help
