"""lambdanet: LambdaNetworks (Bello, ICLR 2021) in PyTorch: lambda layers, LambdaResNets and the convolution
and attention baselines they are measured against."""

from lambdanet import functional
from lambdanet.layers import (
    AbsolutePositionEmbedding,
    LambdaLayer,
    RelativePositionEmbedding,
    create_spatial_layer,
    list_spatial_layers,
)
from lambdanet.models import create_model, list_models, model_args, model_info, register_model

__version__ = "0.2.0.dev0"


def load_model(path, *, ema: bool = True):
    """The trained model of a run directory, its safetensors weights, its ``last.pt`` or ``"hf-hub:owner/name"``,
    in eval mode: an image classifier of ``lambdanet train`` (see
    :func:`lambdanet.tasks.classification.load.load_model`) or a language model of ``lambdanet lm train`` (see
    :func:`lambdanet.tasks.lm.task.load_lm`; ``ema`` does not apply)."""
    from pathlib import Path

    from lambdanet.files import run_task, task_of_config
    from lambdanet.models.hub import hub_repo

    task = None if hub_repo(path) is not None else run_task(path)
    if task is None and Path(path).suffix == ".pt" and Path(path).is_file():  # a checkpoint away from its run
        from lambdanet.engine.checkpoint import load_checkpoint

        task = task_of_config(load_checkpoint(path).get("config") or {})
    if task == "lm":
        from lambdanet.tasks.lm.task import load_lm

        return load_lm(path)
    from lambdanet.tasks.classification.load import load_model as _load

    return _load(path, ema=ema)


def push_to_hub(source, repo_id: str, **kwargs) -> str:
    """Share a run directory, its weights or a model on the Hugging Face hub (see :func:`lambdanet.hub.push_to_hub`);
    ``create_model("hf-hub:" + repo_id)`` loads it back."""
    from lambdanet.hub import push_to_hub as _push

    return _push(source, repo_id, **kwargs)


__all__ = [
    "functional",
    "LambdaLayer",
    "RelativePositionEmbedding",
    "AbsolutePositionEmbedding",
    "create_spatial_layer",
    "list_spatial_layers",
    "create_model",
    "list_models",
    "model_info",
    "model_args",
    "register_model",
    "load_model",
    "push_to_hub",
    "__version__",
]
