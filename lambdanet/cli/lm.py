"""Language-model commands: ``lambdanet lm train`` and ``lambdanet lm sample``."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

__all__ = ["register"]


def _cmd_train(args: argparse.Namespace) -> int:
    """Train a language model (library: ``lambdanet.tasks.lm.train_lm``)."""
    from lambdanet.engine.config import config_source_from_args
    from lambdanet.tasks.lm.config import LMConfig
    from lambdanet.tasks.lm.task import train_lm

    train_lm(config_source_from_args(args, LMConfig).resolve())
    return 0


def _cmd_sample(args: argparse.Namespace) -> int:
    """Continue a prompt with a trained model (library: ``lambdanet.tasks.lm.sample``)."""
    from lambdanet.cli.common import check_device
    from lambdanet.files import check_run_task
    from lambdanet.models.lm import ContextTooLongError
    from lambdanet.models.lm_graph import GrowingStateError
    from lambdanet.tasks.lm.task import sample

    check_device(args.device)
    if args.cuda_graph:  # before the run is loaded: the API's own check, led by the flag that asked for it
        import torch

        from lambdanet.models.lm_graph import StepGraph

        try:
            StepGraph.check_device(torch.device(args.device))
        except ValueError as err:
            raise ValueError(f"--cuda-graph needs --device cuda: {err}") from None
    _check_sampling_flags(args)
    prompt = _prompt_bytes(args)
    check_run_task(args.checkpoint, "lm")  # an image-classification or detection run: say so
    try:
        out = sample(
            args.checkpoint,
            prompt,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            seed=args.seed,
            device="cuda" if args.device == "cuda" else "cpu",
            cuda_graph=args.cuda_graph,
        )
    except GrowingStateError as err:  # the API's refusal of a graph, in the command's words
        raise GrowingStateError(err.what, "--cuda-graph", "sample without --cuda-graph") from None
    except ContextTooLongError as err:  # a model of learnt positions: the flags that ask too many
        raise ContextTooLongError(err.prompt, err.new, err.max_len, flags=True) from None
    text = out.decode("utf-8", errors="replace") + "\n"  # bytes that are not UTF-8: U+FFFD
    encoding = getattr(sys.stdout, "encoding", None) or "utf-8"  # a terminal or pipe of another encoding: its
    sys.stdout.write(text.encode(encoding, errors="replace").decode(encoding))  # "?" for what it lacks, no error
    return 0


def _prompt_bytes(args) -> bytes:
    """``--prompt``'s bytes as given (also those that are not UTF-8: a Latin-1 model's), or ``--prompt-file``'s."""
    if args.prompt is not None:
        return os.fsencode(args.prompt)
    if args.prompt_file == "-":
        return sys.stdin.buffer.read()
    from lambdanet.files import check_path_given

    check_path_given(args.prompt_file, "--prompt-file", "give a file of the prompt's bytes, or '-' for stdin")
    try:
        return Path(args.prompt_file).expanduser().read_bytes()
    except OSError as err:
        raise ValueError(f"--prompt-file {args.prompt_file}: cannot be read ({err.strerror or err})") from None


def _check_sampling_flags(args) -> None:
    """One line naming the flag for a value ``sample`` refuses (its own messages name its arguments)."""
    import math

    if args.max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens must be a non-negative int, got {args.max_new_tokens}")
    if args.top_k is not None and args.top_k < 1:
        raise ValueError(f"--top-k must be a positive int (1: greedy), got {args.top_k}")
    if not (math.isfinite(args.temperature) and args.temperature > 0):
        raise ValueError(f"--temperature must be > 0 and finite, got {args.temperature} (greedy: --top-k 1)")


def register(sub) -> None:
    from lambdanet.engine.config import add_config_arguments, add_threads_argument
    from lambdanet.tasks.lm.config import LMConfig

    lm = sub.add_parser(
        "lm",
        help="byte-level language models (causal lambdas and their baselines)",
        description="Train causal lambda language models and their transformer and linear-attention "
        "baselines on bytes, and sample from them.",
    )
    cmds = lm.add_subparsers(dest="lm_command", metavar="command")
    lm.set_defaults(func=lambda _: (lm.print_help(), 2)[1])
    train = cmds.add_parser(
        "train",
        help="train a language model",
        description=f"Train a byte-level language model. Recipes: {', '.join(LMConfig.RECIPES)}. Every option is "
        "also a YAML key (--config FILE); precedence: defaults < --recipe < --config < flags. --resume "
        "continues the run in --out where it stopped; under torchrun the same command trains with "
        "DistributedDataParallel. summary.json reports val_bits_per_byte on the whole validation split.",
    )
    add_config_arguments(train, LMConfig)
    train.set_defaults(func=_cmd_train)
    smp = cmds.add_parser(
        "sample",
        help="continue a prompt with a trained model",
        description="Continue --prompt (or --prompt-file) with the model of a run of lambdanet lm train, token by "
        "token with the model's streaming state.",
    )
    smp.add_argument(
        "--checkpoint",
        required=True,
        help="run directory of lambdanet lm train (or its model.safetensors / last.pt), or hf-hub:OWNER/NAME (a run "
        "shared with lambdanet push-to-hub)",
    )
    given = smp.add_mutually_exclusive_group(required=True)
    given.add_argument("--prompt", help="text to continue (its bytes as given, UTF-8 or not)")
    given.add_argument(
        "--prompt-file", metavar="PATH", help="continue the bytes of this file ('-': standard input), of any length"
    )
    smp.add_argument("--max-new-tokens", type=int, default=256, help="bytes to generate (default: 256)")
    smp.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (default: 0.8)")
    smp.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest bytes (1: greedy)")
    smp.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    smp.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="device (default: cpu)")
    smp.add_argument(
        "--cuda-graph",
        action="store_true",
        help="replay each generation step from one CUDA graph (--device cuda; the lambda and linear models, "
        "whose state keeps its size)",
    )
    add_threads_argument(smp)
    smp.set_defaults(func=_cmd_sample)
