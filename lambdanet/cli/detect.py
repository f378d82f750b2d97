"""``lambdanet detect``: Mask R-CNN with a lambdanet backbone."""

from __future__ import annotations

import argparse

__all__ = ["register"]


def _cmd_detect(args: argparse.Namespace) -> int:
    """Train and evaluate a detector (library: ``lambdanet.tasks.detection.task.train_detector``)."""
    from lambdanet.tasks.detection.task import DetectConfig, local_processes, train_detector
    from lambdanet.engine.config import config_source_from_args

    cfg = config_source_from_args(args, DetectConfig).resolve()
    if args.threads is not None and (procs := local_processes(cfg)) > 1:  # each worker gets its share of the cores
        raise ValueError(
            f"--threads sets the threads of one process, and this run trains in {procs} local processes "
            "that share the cores out among them: add --procs 1 to choose the threads"
        )
    train_detector(cfg)
    return 0


def _add_detect(sub) -> None:
    from lambdanet.tasks.detection.config import DETECT_RECIPES, DetectConfig
    from lambdanet.engine.config import add_config_arguments

    detect = sub.add_parser(
        "detect",
        help="train and evaluate Mask R-CNN / Faster R-CNN on a lambda, halo or convolution backbone",
        description=f"Detection and instance segmentation (LambdaNetworks Table 6, HaloNet Table 5): torchvision's "
        f"Mask R-CNN on an FPN over a registered backbone. Recipes: {', '.join(DETECT_RECIPES)} (paper: "
        "App. E.2's 1024 px COCO recipe). Data: glyphs (built-in offline scenes) or coco:DIR. "
        "Evaluation: COCO box and mask AP with pycocotools, in summary.json. Every option is also a YAML "
        "key (--config); --resume continues the run in --out; under torchrun it trains with "
        "DistributedDataParallel.",
    )
    add_config_arguments(detect, DetectConfig)
    detect.set_defaults(func=_cmd_detect)


def register(sub) -> None:
    """Add this module's commands to the subparsers ``sub``."""
    _add_detect(sub)
