"""Training and evaluation: configs and recipes, the loops, checkpoints, distributed runs."""

from lambdanet.train.config import RECIPES, TrainConfig, resolve_config
from lambdanet.engine.loop import NonFiniteLossError, evaluate, train_one_epoch
from lambdanet.train.load import load_model
from lambdanet.train.trainer import TrainingDivergedError, evaluate_checkpoint, train

__all__ = ["TrainConfig", "RECIPES", "resolve_config", "train", "evaluate_checkpoint", "train_one_epoch", "evaluate",
           "NonFiniteLossError", "TrainingDivergedError", "load_model"]
