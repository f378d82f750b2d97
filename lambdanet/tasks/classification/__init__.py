"""Image classification, a task of the engine: configs and recipes, ``train``, evaluation, loading runs."""

from lambdanet.engine.loop import NonFiniteLossError
from lambdanet.tasks.classification.config import RECIPES, TrainConfig, resolve_config
from lambdanet.tasks.classification.load import load_model
from lambdanet.tasks.classification.metrics import evaluate
from lambdanet.tasks.classification.task import TrainingDivergedError, evaluate_checkpoint, train

__all__ = [
    "TrainConfig",
    "RECIPES",
    "resolve_config",
    "train",
    "evaluate_checkpoint",
    "evaluate",
    "NonFiniteLossError",
    "TrainingDivergedError",
    "load_model",
]
