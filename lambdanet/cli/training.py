"""Training commands: ``lambdanet train``, ``eval``, ``sweep`` and ``pseudo-label``."""

from __future__ import annotations

import argparse

__all__ = ["register"]


def _cmd_train(args: argparse.Namespace) -> int:
    """Train and evaluate a model (library: ``lambdanet.tasks.classification.train``)."""
    from lambdanet.tasks.classification.config import config_from_args
    from lambdanet.tasks.classification.task import train

    train(config_from_args(args))
    return 0


def _add_train(sub) -> None:
    from lambdanet.tasks.classification.datasets import list_datasets
    from lambdanet.engine.config import add_config_arguments
    from lambdanet.tasks.classification.config import RECIPES, TrainConfig

    recipes = ", ".join(RECIPES)
    train = sub.add_parser(
        "train",
        help="train and evaluate a model",
        description=f"Train and evaluate. Recipes: {recipes}. Data: {', '.join(list_datasets())}. Every option is "
        "also a YAML key (--config FILE); precedence: defaults < --recipe < --config < flags. "
        "--resume continues the run in --out where it stopped. --checkpoint RUN_OR_FILE fine-tunes a "
        "run's model (its architecture and image size unless given) or timm's weights, adapting the "
        "input channels and the classifier to the data. Under torchrun the same command trains "
        "with DistributedDataParallel.",
    )
    add_config_arguments(train, TrainConfig)
    train.set_defaults(func=_cmd_train)


def _cmd_eval(args: argparse.Namespace) -> int:
    """Top-1 / top-5 of a checkpoint on a dataset (library: ``lambdanet.tasks.classification.evaluate_checkpoint``)."""
    import json

    from lambdanet.cli.common import check_device
    from lambdanet.files import check_path_given, check_run_task
    from lambdanet.helpers import check_positive_int
    from lambdanet.tasks.classification.task import evaluate_checkpoint

    check_positive_int(args.batch_size, "--batch-size")
    if args.data_dir is not None:
        check_path_given(args.data_dir, "--data-dir", "give a dataset folder, or leave it out (the checkpoint's)")
    check_device(args.device)
    check_run_task(args.checkpoint, "classify")  # a language-model or detection run: say so
    res = evaluate_checkpoint(
        args.checkpoint,
        data=args.data,
        split=args.split,
        ema=not args.no_ema,
        batch_size=args.batch_size,
        device=args.device,
        data_dir=args.data_dir,
        download=args.download,
    )
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        trained = res.get("trained") or f"epoch {res['epoch']}"
        print(
            f"{res['model']} ({res['weights']} weights, {trained}) on {res['data']} {res['split']}: "
            f"top-1 {res['top1']:.4f}, top-5 {res['top5']:.4f}, loss {res['loss']:.4f} ({res['samples']} images)"
        )
    return 0


def _add_eval(sub) -> None:
    from lambdanet.engine.config import add_threads_argument

    ev = sub.add_parser(
        "eval",
        help="evaluate a checkpoint",
        description="Top-1/top-5 accuracy and loss of a training checkpoint (its EMA weights when it "
        "has them) on its dataset or another one.",
    )
    ev.add_argument(
        "--checkpoint",
        required=True,
        help="a run directory of lambdanet train or its last.pt (the training checkpoint)",
    )
    ev.add_argument("--data", default=None, help="dataset (default: the checkpoint's)")
    ev.add_argument("--data-dir", default=None, help="dataset folder (default: the checkpoint's)")
    ev.add_argument(
        "--download",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="download a dataset that is not on disk (default: as the run did)",
    )
    ev.add_argument("--split", default="test", choices=["test", "train"], help="split to evaluate (default: test)")
    ev.add_argument("--batch-size", type=int, default=256, help="evaluation batch size (default: 256)")
    ev.add_argument(
        "--device", default="auto", choices=["auto", "cpu", "cuda"], help="device (default: auto = CUDA when available)"
    )
    ev.add_argument("--no-ema", action="store_true", help="use the raw weights even if an EMA exists")
    ev.add_argument("--json", action="store_true", help="print the result as JSON")
    add_threads_argument(ev)
    ev.set_defaults(func=_cmd_eval)


def _cmd_sweep(args: argparse.Namespace) -> int:
    """Learning-rate sensitivity study (library: ``lambdanet.tasks.classification.sweep.lr_sweep``)."""
    from lambdanet.engine.config import config_source_from_args
    from lambdanet.tasks.classification.config import TrainConfig
    from lambdanet.tasks.classification.sweep import lr_sweep, sweep_markdown

    source = config_source_from_args(args, TrainConfig)
    if "lr" in source.overrides:  # (a --config file's lr is the one every sweep run replaces: no error)
        raise ValueError(f"--lr {args.lr} does not apply to sweep, which trains once per rate of --lrs; give the "
                         "rates there")  # fmt: skip
    print(sweep_markdown(lr_sweep(source, args.lrs, args.models)))
    return 0


def _add_sweep(sub) -> None:
    from lambdanet.engine.config import add_config_arguments
    from lambdanet.tasks.classification.config import TrainConfig

    sw = sub.add_parser(
        "sweep",
        help="learning-rate sensitivity study",
        description="Train the same recipe at several learning rates (and models) into "
        "--out/<model>/lr_<lr>; writes sweep.md, sweep.json and sweep.png (accuracy vs "
        "learning rate) into --out. Rerunning reuses finished runs of the same resolved "
        "configuration and resumes unfinished ones; a run folder holding another "
        "configuration is refused. Every train option applies but --lr (the rates are --lrs).",
    )
    sw.add_argument("--lrs", type=float, nargs="+", required=True, help="learning rates")
    sw.add_argument("--models", nargs="+", default=None, help="models (default: --model)")
    add_config_arguments(sw, TrainConfig)
    sw.set_defaults(func=_cmd_sweep)


def _cmd_pseudo(args: argparse.Namespace) -> int:
    """Pseudo-label a teacher's unlabelled images (``lambdanet.tasks.classification.pseudo.make_pseudo_labels``)."""
    from lambdanet.engine.values import check_number
    from lambdanet.files import check_output_file, check_run_task
    from lambdanet.tasks.classification.pseudo import make_pseudo_labels

    check_number(args.threshold, "--threshold", 0, 1, note=" (a softmax confidence)")
    check_output_file(args.out, "--out")
    check_run_task(args.checkpoint, "classify")
    res = make_pseudo_labels(args.checkpoint, args.out, threshold=args.threshold)
    agree = res["agreement_with_true_labels"]
    print(
        f"{len(res['labels'])} pseudo-labels for {res['data']} (labeled_fraction {res['labeled_fraction']}, "
        f"seed {res['seed']}), "
        + (f"{agree:.4f} of them agree with the hidden labels" if len(res["labels"]) else "none reaches --threshold")
        + f" -> {args.out}"
    )
    return 0


def _add_pseudo_label(sub) -> None:
    from lambdanet.engine.config import add_threads_argument

    ps = sub.add_parser(
        "pseudo-label",
        help="label a teacher's unlabelled images",
        description="Label the unlabelled part (1 - labeled_fraction) of a teacher run's training "
        "set; train a student with --labeled-fraction F --pseudo-labels FILE.",
    )
    ps.add_argument(
        "--checkpoint",
        required=True,
        help="the teacher's run directory or its last.pt (trained with --labeled-fraction < 1)",
    )
    ps.add_argument("--out", required=True, help="output file (.pt)")
    ps.add_argument(
        "--threshold", type=float, default=0.0, help="keep labels with at least this confidence, in [0, 1] (default: 0)"
    )
    add_threads_argument(ps)
    ps.set_defaults(func=_cmd_pseudo)


def register(sub) -> None:
    """Add this module's commands to the subparsers ``sub``."""
    _add_train(sub)
    _add_eval(sub)
    _add_sweep(sub)
    _add_pseudo_label(sub)
