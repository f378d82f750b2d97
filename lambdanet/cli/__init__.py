"""Command-line interface: a thin layer over library functions, one module per group of commands
(``info``, ``training``, ``lm``, ``deploy``, ``detect``, ``bench``), each adding its commands with ``register``.

``lambdanet <command> --help`` documents each command.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import cast

from lambdanet.cli import bench, deploy, detect, info, lm, training

__all__ = ["main", "build_parser"]

DESCRIPTION = (
    "lambdanet: LambdaNetworks (Bello, ICLR 2021) in PyTorch: lambda layers, LambdaResNets and the "
    "convolution / attention baselines they are measured against (SE, linear, relative, local, axial "
    "and halo attention), with the papers' models, training recipes and benchmarks."
)


def _message(err: BaseException) -> str:
    """A user error's message; one raised in a DataLoader worker comes back wrapped (``Caught ValueError in
    DataLoader worker process 0.`` and the worker's traceback): its own last line, without the type name."""
    text = str(err)
    if "DataLoader worker process" not in text.split("\n", 1)[0]:
        return text
    lines = text.strip().splitlines()
    head = re.compile(rf"(?:[\w.]+\.)?{re.escape(type(err).__name__)}: ?")  # ValueError: / lambdanet.x.CheckpointError:
    start = max((i for i, line in enumerate(lines) if head.match(line)), default=len(lines) - 1)
    return "\n".join([head.sub("", lines[start], count=1), *lines[start + 1 :]])


def _out_of_memory(err: BaseException) -> str:
    """What ran out, where ``err`` says a tensor did not fit (torch's ``OutOfMemoryError`` on a GPU, the CPU
    allocator's failure, a size past 64 bits, Python's ``MemoryError``); ``""`` for any other error."""
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    if isinstance(err, MemoryError) or type(err).__name__ == "OutOfMemoryError":
        return first[:200] or "MemoryError"
    if "DefaultCPUAllocator: can't allocate memory" in first:
        return "the CPU allocator " + first[first.index("can't allocate") :][:160]
    if "Storage size calculation overflowed" in first:
        return "a tensor larger than 2**63 bytes"
    return ""


def _user_errors() -> tuple[type[BaseException], ...]:
    from lambdanet.helpers import MissingExtraError
    from lambdanet.tasks.classification.task import TrainingDivergedError

    return (ValueError, TrainingDivergedError, FileNotFoundError, MissingExtraError)


class CommandParser(argparse.ArgumentParser):
    """The ``lambdanet`` parser: ``commands`` maps each command to its own (plain ``ArgumentParser``); looking up
    ``None`` (no command given) finds none."""

    commands: dict[str | None, argparse.ArgumentParser]


def build_parser() -> CommandParser:
    from lambdanet import __version__

    parser = CommandParser(
        prog="lambdanet", description=DESCRIPTION, epilog="Run 'lambdanet COMMAND --help' for a command's options."
    )
    parser.add_argument("--version", action="version", version=f"lambdanet {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="command", parser_class=argparse.ArgumentParser)
    # name -> subparser, for errors in a command's own usage
    parser.commands = cast("dict[str | None, argparse.ArgumentParser]", sub.choices)
    for module in (info, training, lm, deploy, detect, bench):  # the order of 'lambdanet --help'
        module.register(sub)
    return parser


def _subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The parser of subcommand ``name`` of ``parser`` (``lm`` -> ``lm train``), or ``parser`` itself."""
    for action in parser._subparsers._group_actions if parser._subparsers else ():
        if isinstance(action, argparse._SubParsersAction) and name in action.choices:
            return action.choices[name]
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # a mistyped option: the (sub)command's usage, not the top-level one ('lm train': lm train's)
        where = parser.commands.get(getattr(args, "command", None), parser)
        command = " ".join(c for c in (args.command, getattr(args, "lm_command", None)) if c)
        if getattr(args, "lm_command", None):
            where = _subcommand(where, args.lm_command)
        where.error(f"unrecognized arguments: {' '.join(extra)} (see 'lambdanet {command} --help')")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from lambdanet.engine.preempt import Preempted, exit_status
    from lambdanet.runtime import intra_op_threads

    command = " ".join(c for c in (args.command, getattr(args, "lm_command", None)) if c)  # 'lm sample'
    try:
        with intra_op_threads(getattr(args, "threads", None), "--threads"):  # the commands with --threads N
            code = int(args.func(args) or 0)
        sys.stdout.flush()  # here, where a reader that went away is handled below, not at the interpreter's exit
        return code
    except Preempted as err:  # a checkpoint was saved: one line, and the signal's conventional exit status
        print(f"lambdanet {command}: {err}", file=sys.stderr)
        return exit_status(err)
    except _user_errors() as err:
        print(f"lambdanet {command}: error: {_message(err)}", file=sys.stderr)
        return 2
    except (MemoryError, RuntimeError) as err:
        if not (ran_out := _out_of_memory(err)):
            raise
        print(f"lambdanet {command}: error: out of memory ({ran_out}); lower the sizes asked (batch, image or model "
              "size, context, vocabulary)", file=sys.stderr)  # fmt: skip
        return 1
    except BrokenPipeError:  # the reader of the output went away (lambdanet predict --json | head): quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush writes nowhere
        return 128 + 13  # as a process killed by SIGPIPE
