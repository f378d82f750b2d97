"""Using trained models: ``lambdanet predict`` and ``lambdanet export``."""

from __future__ import annotations

import argparse

__all__ = ["register"]


def _cmd_predict(args: argparse.Namespace) -> int:
    """Classify image files (library: ``lambdanet.predict.predict``)."""
    import json

    import torch

    from lambdanet.cli.common import check_device
    from lambdanet.helpers import check_positive_int
    from lambdanet.predict import find_images, load_for_inference, predict, resolve_dtype

    check_positive_int(args.top_k, "--top-k")
    dtype = resolve_dtype(args.dtype, "--dtype")
    if args.pretrained and args.checkpoint is not None:
        raise ValueError("--pretrained and --checkpoint exclude each other: the weights come from one of them")
    if args.pretrained and args.model is None:
        raise ValueError("--pretrained needs --model NAME (the model whose published weights to use)")
    if not args.pretrained and args.checkpoint is None:
        raise ValueError(
            "give the weights: --checkpoint PATH (a run directory, .safetensors or last.pt) or "
            "--model NAME --pretrained"
        )
    check_device(args.device)
    device = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    images = find_images(args.images)  # before loading the model: a wrong path fails fast
    model = load_for_inference(
        args.checkpoint, model=args.model, pretrained=args.pretrained, ema=not args.no_ema, dtype=dtype
    ).to(device)
    results = predict(model, images, top_k=args.top_k)
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    for r in results:
        print(r["image"])
        width = len(str(len(r["top_k"])))  # ranks right-aligned: the columns line up at --top-k 10 and beyond
        for rank, c in enumerate(r["top_k"], 1):
            index = "" if c["label"] == str(c["index"]) else f" (class {c['index']})"
            print(f"  {rank:>{width}}. {c['prob']:8.2%}  {c['label']}{index}")
    return 0


def _add_predict(sub) -> None:
    from lambdanet.engine.config import add_threads_argument
    from lambdanet.predict import DTYPES, IMAGE_SUFFIXES

    pr = sub.add_parser(
        "predict",
        help="classify image files",
        description="Top-k classes of image files with a trained run (--checkpoint) or a model's "
        "published weights (--model NAME --pretrained), preprocessed as the model's "
        f"pretrained_cfg says. A folder stands for every {'/'.join(IMAGE_SUFFIXES)} "
        "file under it (recursively, sorted).",
    )
    pr.add_argument("images", nargs="+", metavar="IMAGE", help="image files or folders of images")
    pr.add_argument(
        "--model",
        default=None,
        help="registered model name (with --pretrained; with --checkpoint optional: it must be the run's model)",
    )
    pr.add_argument("--pretrained", action="store_true", help="use the model's published weights")
    pr.add_argument(
        "--checkpoint",
        default=None,
        help="a run directory, its .safetensors weights or its last.pt (lambdanet train), or hf-hub:OWNER/NAME (a run "
        "shared with lambdanet push-to-hub); with --model, a weights file of that model (timm's checkpoint or "
        "lambdanet's own)",
    )
    pr.add_argument(
        "--no-ema",
        action="store_true",
        help="a run's raw weights even where it kept an EMA of them (default: the EMA's)",
    )
    pr.add_argument("--top-k", type=int, default=5, help="classes shown per image (default: %(default)s)")
    pr.add_argument("--json", action="store_true", help="print the predictions as JSON")
    pr.add_argument(
        "--device", default="auto", choices=["auto", "cpu", "cuda"], help="device (default: auto = CUDA when available)"
    )
    pr.add_argument(
        "--dtype",
        default="float32",
        metavar="DTYPE",
        help=f"precision the model runs in, one of {', '.join(DTYPES)} (default: %(default)s; float16 "
        "is slow on a CPU)",
    )
    add_threads_argument(pr)
    pr.set_defaults(func=_cmd_predict)


def _cmd_export(args: argparse.Namespace) -> int:
    """Export a model to ONNX, TorchScript or an ExportedProgram (library: ``lambdanet.export.export_model``)."""
    from pathlib import Path

    from lambdanet.export import default_export_path, export_model
    from lambdanet.files import check_output_file, run_file
    from lambdanet.models import model_info
    from lambdanet.predict import load_for_inference

    dtype = _check_export_args(args)
    model = load_for_inference(
        args.checkpoint,
        model=args.model,
        pretrained=args.pretrained,
        num_classes=args.num_classes,
        img_size=args.img_size,
        ema=not args.no_ema,
        dtype=dtype,
    )
    cfg = getattr(model, "pretrained_cfg", None) or {}
    name = cfg.get("architecture") or args.model
    in_chans, _, cfg_size = cfg.get("input_size") or (3, None, None)
    size = args.img_size or cfg_size or model_info(name).input_size
    out = Path(args.out or default_export_path(name, args.format)).expanduser()
    check_output_file(out, "--out")
    if args.checkpoint and out.resolve() == run_file(args.checkpoint).expanduser().resolve():
        raise ValueError(f"--out {args.out} is the --checkpoint being exported; choose another --out")
    try:
        res = export_model(
            model,
            out,
            args.format,
            input_size=size,
            in_chans=in_chans,
            check=not args.no_check,
            batch_size=args.batch_size,
            dynamic_batch=not args.static_batch,
        )
    except ValueError as err:  # a size the model's global position layers were not built for: name the option
        if args.img_size is not None and cfg_size and args.img_size != cfg_size and "feat_size" in str(err):
            raise ValueError(f"--img-size {args.img_size} does not suit this model, built for {cfg_size} px "
                             f"(export at --img-size {cfg_size}): {err}") from None  # fmt: skip
        raise
    shape = (["batch"] if res["dynamic_batch"] else []) + res["input_shape"][1 if res["dynamic_batch"] else 0 :]
    batches = " and ".join(map(str, res["check_batches"]))
    if res["checked"]:
        against = "ONNX Runtime" if args.format == "onnx" else "reloaded"
        check = (
            f"check passed at batch {batches} ({against} vs eager): max abs error {res['max_abs_error']:.3g} "
            f"<= tolerance {res['tolerance']:.3g}"
        )
    else:
        check = "check skipped"
    print(f"{res['path']}: {args.format} {res['dtype']}, input [{', '.join(map(str, shape))}]; {check}")
    if res["external_data"]:
        print(
            f"{res['path']}: the weights are too large for one .onnx file (2 GB protobuf limit) and are in "
            f"{res['external_data']}, which must stay next to it"
        )
    return 0


def _check_export_args(args: argparse.Namespace):
    """``lambdanet export``'s arguments, before any model is loaded (a one-line ``ValueError`` naming the
    option); returns the dtype asked for."""
    from lambdanet.export import FORMATS, check_dtype, require_format, trace_batch
    from lambdanet.files import check_output_file
    from lambdanet.helpers import check_choice, check_int, check_positive_int
    from lambdanet.models import list_models
    from lambdanet.predict import resolve_dtype

    if args.model is None and args.checkpoint is None:
        raise ValueError("give --model NAME, --checkpoint PATH (a run), or both (a weights file of that model)")
    if args.pretrained and args.model is None:
        raise ValueError("--pretrained goes with --model NAME (a --checkpoint holds its own weights)")
    check_choice(args.format, "--format", FORMATS)
    if args.img_size is not None:
        check_positive_int(args.img_size, "--img-size")
    if args.num_classes is not None:
        check_int(args.num_classes, "--num-classes", 0, note=" (0: the pooled features)")
    if args.model in list_models(task="lm"):
        raise ValueError(f"{args.model} is a language model; lambdanet export takes image models")
    if args.out is not None:
        check_output_file(args.out, "--out")
    dtype = resolve_dtype(args.dtype, "--dtype")
    check_dtype(args.format, dtype, "--dtype")
    trace_batch(args.batch_size, not args.static_batch, "--batch-size", "a dynamic batch", "; or add --static-batch")
    require_format(args.format, check=not args.no_check)  # missing packages: before loading the model
    return dtype


def _add_export(sub) -> None:
    from lambdanet.engine.config import add_threads_argument
    from lambdanet.export import FORMAT_DTYPES, FORMATS, ONNX_INSTALL, SUFFIXES

    ex = sub.add_parser(
        "export",
        help="export a model to ONNX, TorchScript or a torch.export program",
        description="Write a model (--model NAME, random or --pretrained weights, or a trained "
        "--checkpoint) as ONNX (dynamo exporter, one self-contained .onnx file unless "
        "the weights exceed 1.5 GB, checked with ONNX Runtime; needs "
        f"{ONNX_INSTALL}), TorchScript (torch.jit.trace) or an ExportedProgram "
        "(torch.export, .pt2), for inputs [batch, C, N, N] of any batch (traced at "
        "batch 2; --static-batch: the traced batch only), then load it back and "
        "compare it with the eager model at batch 1 and at the traced batch + 1.",
    )
    ex.add_argument("--model", default=None, help="registered model name")
    ex.add_argument("--pretrained", action="store_true", help="with --model: its published weights")
    ex.add_argument(
        "--checkpoint",
        default=None,
        help="a run directory, its .safetensors weights or its last.pt (lambdanet train), or hf-hub:OWNER/NAME (a run "
        "shared with lambdanet push-to-hub); with --model, a weights file of that model (timm's checkpoint or "
        "lambdanet's own)",
    )
    ex.add_argument(
        "--no-ema",
        action="store_true",
        help="a run's raw weights even where it kept an EMA of them (default: the EMA's)",
    )
    ex.add_argument("--format", required=True, metavar="FORMAT", help=f"one of {', '.join(FORMATS)}")
    ex.add_argument(
        "--out", default=None, help="output file (default: <model>" + "|".join(SUFFIXES.values()) + " in this folder)"
    )
    ex.add_argument(
        "--img-size",
        type=int,
        default=None,
        help="input height and width (default: the model's pretrained_cfg or paper input size)",
    )
    ex.add_argument("--num-classes", type=int, default=None, help="with --model: classifier outputs")
    ex.add_argument("--no-check", action="store_true", help="skip loading the export back and comparing")
    ex.add_argument(
        "--dtype",
        default="float32",
        metavar="DTYPE",
        help="precision of the exported model and its input: "
        + "; ".join(f"{f}: {', '.join(d)}" for f, d in FORMAT_DTYPES.items())
        + " (default: %(default)s)",
    )
    ex.add_argument("--static-batch", action="store_true", help="export for the traced batch only (default: any batch)")
    ex.add_argument(
        "--batch-size", type=int, default=None, help="batch the export is traced on (default: 2; 1 with --static-batch)"
    )
    add_threads_argument(ex)
    ex.set_defaults(func=_cmd_export)


def _cmd_push(args: argparse.Namespace) -> int:
    """Share a run on the Hugging Face hub (library: ``lambdanet.hub.push_to_hub`` / ``save_for_hub``)."""
    from lambdanet.files import check_output_dir
    from lambdanet.hub import push_to_hub, save_for_hub

    if args.folder is not None:  # an empty --folder is refused, not taken for none (an upload)
        check_output_dir(args.folder, "--folder", "the folder receiving the repository's files", writable=True)
        folder = save_for_hub(args.run, args.folder, args.repo_id)
        print(
            f"{args.run} -> {folder} ({', '.join(sorted(p.name for p in folder.iterdir()))}); upload it with "
            f"lambdanet push-to-hub {args.run} {args.repo_id}{' --private' * args.private}"
        )
        return 0
    url = push_to_hub(args.run, args.repo_id, private=args.private)
    print(f"{args.run} -> {url}; load it with lambdanet.create_model('hf-hub:{args.repo_id}')")
    return 0


def _add_push(sub) -> None:
    push = sub.add_parser(
        "push-to-hub",
        help="share a trained run on the Hugging Face hub",
        description="Upload a lambdanet train run (its weights with their description, a "
        "config.json, a model card with the run's metrics, config.yaml and "
        "summary.json) to a Hugging Face hub repository, created when missing; "
        "create_model('hf-hub:OWNER/NAME') and load_model('hf-hub:OWNER/NAME') load "
        "it. Needs a token with write access (huggingface-cli login).",
    )
    push.add_argument("run", help="the run directory (or its model.safetensors / model_ema.safetensors)")
    push.add_argument("repo_id", help="the hub repository, OWNER/NAME")
    push.add_argument("--private", action="store_true", help="create the repository private")
    push.add_argument(
        "--folder", default=None, help="write the repository's files into this folder instead of uploading them"
    )
    push.set_defaults(func=_cmd_push)


def register(sub) -> None:
    """Add this module's commands to the subparsers ``sub``."""
    _add_predict(sub)
    _add_export(sub)
    _add_push(sub)
