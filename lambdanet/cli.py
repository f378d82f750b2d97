"""Command-line interface: a thin layer over library functions.

``lambdanet <command> --help`` documents each command.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

__all__ = ["main", "build_parser"]

DESCRIPTION = ("lambdanet: LambdaNetworks (Bello, ICLR 2021) in PyTorch: lambda layers, LambdaResNets and the "
               "convolution / attention baselines they are measured against (SE, linear, relative, local, axial "
               "and halo attention), with the papers' models, training recipes and benchmarks.")


def _cmd_demo(args: argparse.Namespace) -> int:
    """Run one lambda layer forward and backward on random data and print what it did."""
    import torch

    from lambdanet import LambdaLayer

    layer = LambdaLayer(args.dim, dim_k=args.dim_k, heads=args.heads, r=args.r)
    x = torch.randn(args.batch, args.dim, args.size, args.size)
    t0 = time.perf_counter()
    y = layer(x)
    y.float().pow(2).mean().backward()
    dt = time.perf_counter() - t0
    params = sum(p.numel() for p in layer.parameters())
    print(layer)
    print(f"input {tuple(x.shape)} -> output {tuple(y.shape)}; {params:,} parameters; "
          f"forward+backward {dt * 1e3:.1f} ms (impl={layer.choose_impl((args.size, args.size))})")
    return 0


def _cmd_models(args: argparse.Namespace) -> int:
    """Print every registered model (params, FLOPs, input size) or the paper-table comparison."""
    from lambdanet.models.summary import markdown_table, paper_comparison, summarize_models

    if args.paper:
        import fnmatch

        from lambdanet.models.paper_tables import PAPER_ROWS

        picked = [r for r in PAPER_ROWS if args.pattern is None or (r.model and fnmatch.fnmatch(r.model, args.pattern))
                  or r.table == args.pattern]
        if not picked:
            print(f"no paper-table row has a model matching {args.pattern!r} (or is table {args.pattern!r})",
                  file=sys.stderr)
            return 1
        rows = paper_comparison(picked, flops=not args.no_flops)
        for r in rows:
            r["ours"] = f"{r['params_m']:.2f}" if r.get("params_m") is not None else "-"
            r["delta_s"] = f"{r['delta']:+.1%}" if r.get("delta") is not None else "-"
            r["flops_s"] = f"{r['flops_g']:.2f}" if r.get("flops_g") is not None else "-"
        print(markdown_table(rows, [("table", "table"), ("row", "row"), ("call", "create_model call"),
                                    ("paper_params_m", "paper (M)"), ("ours", "ours (M)"), ("delta_s", "delta"),
                                    ("paper_flops_g", "paper GFLOPs"), ("flops_s", "our GFLOPs")]))
        return 0
    rows = summarize_models(args.pattern, flops=not args.no_flops)
    if args.pretrained:  # the models with published weights, their hub ids and accuracy
        from lambdanet.models.registry import published_models

        published = published_models()
        rows = [r for r in rows if r["model"] in published]
        for r in rows:
            p = published[r["model"]]
            r["hub_id"], r["top1"] = p.hub_id, "-" if p.top1 is None else f"{p.top1:.1f}"
    if not rows:
        print(f"no registered model{' with pretrained weights' if args.pretrained else ''} matches "
              f"{args.pattern!r}", file=sys.stderr)
        return 1
    for r in rows:
        r["params_m"] = f"{r['params'] / 1e6:.2f}"
        r["gflops"] = f"{r['flops'] / 1e9:.2f}" if r["flops"] is not None else "-"
    columns = [("model", "model"), ("params_m", "params (M)"), ("gflops", "GFLOPs"), ("input_size", "input size")]
    if args.pretrained:
        columns += [("hub_id", "weights (Hugging Face hub)"), ("top1", "ImageNet top-1")]
    print(markdown_table(rows, columns))
    return 0


def _user_errors() -> tuple[type[BaseException], ...]:
    from lambdanet.train.trainer import TrainingDivergedError

    return (ValueError, TrainingDivergedError, FileNotFoundError)


def _cmd_train(args: argparse.Namespace) -> int:
    """Train and evaluate a model (library: ``lambdanet.train.train``)."""
    from lambdanet.train.config import config_from_args
    from lambdanet.train.trainer import train

    cfg = config_from_args(args)
    train(cfg)
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    """Top-1 / top-5 of a checkpoint on a dataset (library: ``lambdanet.train.evaluate_checkpoint``)."""
    import json

    from lambdanet.train.trainer import evaluate_checkpoint

    res = evaluate_checkpoint(args.checkpoint, data=args.data, split=args.split, ema=not args.no_ema,
                              batch_size=args.batch_size, device=args.device, data_dir=args.data_dir)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print(f"{res['model']} ({res['weights']} weights, epoch {res['epoch']}) on {res['data']} {res['split']}: "
              f"top-1 {res['top1']:.4f}, top-5 {res['top5']:.4f}, loss {res['loss']:.4f} ({res['samples']} images)")
    return 0


def _cmd_sweep(args: argparse.Namespace) -> int:
    """Learning-rate sensitivity study (library: ``lambdanet.train.sweep.lr_sweep``)."""
    from lambdanet.train.config import config_source_from_args
    from lambdanet.train.sweep import lr_sweep, sweep_markdown

    rows = lr_sweep(config_source_from_args(args), args.lrs, args.models)
    print(sweep_markdown(rows))
    return 0


def _cmd_pseudo(args: argparse.Namespace) -> int:
    """Pseudo-label a teacher's unlabelled images (library: ``lambdanet.train.pseudo.make_pseudo_labels``)."""
    from lambdanet.train.pseudo import make_pseudo_labels

    res = make_pseudo_labels(args.checkpoint, args.out, threshold=args.threshold)
    print(f"{len(res['labels'])} pseudo-labels for {res['data']} (labeled_fraction {res['labeled_fraction']}, "
          f"seed {res['seed']}), {res['agreement_with_true_labels']:.4f} agree with the hidden labels -> {args.out}")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    """Benchmarks (library: ``lambdanet.bench.runner.run_benchmarks``)."""
    from lambdanet.bench.runner import DEFAULT_PARTS, run_benchmarks

    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--device cuda but no CUDA device is available")
    run_benchmarks(args.parts or DEFAULT_PARTS, device=args.device, out=args.out, quick=args.quick,
                   suites=args.suites, img_size=args.img_size, batch_size=args.batch_size, repeats=args.repeats,
                   amp=args.amp, channels_last=args.channels_last, compile=args.compile, layers=args.layers)
    return 0


def _cmd_predict(args: argparse.Namespace) -> int:
    """Classify image files (library: ``lambdanet.predict.predict``)."""
    import json

    import torch

    from lambdanet.helpers import check_positive_int
    from lambdanet.predict import (
        find_images,
        load_for_inference,
        predict,
        resolve_dtype,
    )

    check_positive_int(args.top_k, "--top-k")
    dtype = resolve_dtype(args.dtype, "--dtype")
    if args.pretrained and args.checkpoint is not None:
        raise ValueError("--pretrained and --checkpoint exclude each other: the weights come from one of them")
    if args.pretrained and args.model is None:
        raise ValueError("--pretrained needs --model NAME (the model whose published weights to use)")
    if not args.pretrained and args.checkpoint is None:
        raise ValueError("give the weights: --checkpoint PATH (a run directory, .safetensors or last.pt) or "
                         "--model NAME --pretrained")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but no CUDA device is available")
    device = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    images = find_images(args.images)  # before loading the model: a wrong path fails fast
    model = load_for_inference(args.checkpoint, model=args.model, pretrained=args.pretrained, dtype=dtype).to(device)
    results = predict(model, images, top_k=args.top_k)
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    for r in results:
        print(r["image"])
        for rank, c in enumerate(r["top_k"], 1):
            index = "" if c["label"] == str(c["index"]) else f" (class {c['index']})"
            print(f"  {rank}. {c['prob']:8.2%}  {c['label']}{index}")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    """Export a model to ONNX, TorchScript or an ExportedProgram (library: ``lambdanet.export.export_model``)."""
    from lambdanet.export import (
        FORMATS,
        check_dtype,
        default_export_path,
        export_model,
        require_format,
    )
    from lambdanet.helpers import check_choice, check_positive_int
    from lambdanet.models import model_info
    from lambdanet.predict import load_for_inference, resolve_dtype

    if args.model is None and args.checkpoint is None:
        raise ValueError("give --model NAME, --checkpoint PATH (a run), or both (a weights file of that model)")
    if args.pretrained and args.model is None:
        raise ValueError("--pretrained goes with --model NAME (a --checkpoint holds its own weights)")
    check_choice(args.format, "--format", FORMATS)
    dtype = resolve_dtype(args.dtype, "--dtype")
    check_dtype(args.format, dtype, "--dtype")
    if args.batch_size is not None:
        check_positive_int(args.batch_size, "--batch-size")
    if not args.static_batch and args.batch_size is not None and args.batch_size < 2:
        raise ValueError(f"--batch-size must be at least 2 with a dynamic batch (torch.export specialises a "
                         f"dimension of size 1), got {args.batch_size}; or add --static-batch")
    require_format(args.format, check=not args.no_check)  # missing packages: before loading the model
    model = load_for_inference(args.checkpoint, model=args.model, pretrained=args.pretrained,
                               num_classes=args.num_classes, img_size=args.img_size, dtype=dtype)
    cfg = getattr(model, "pretrained_cfg", None) or {}
    name = cfg.get("model") or args.model
    size = args.img_size or cfg.get("image_size") or model_info(name).input_size
    out = args.out or default_export_path(name, args.format)
    res = export_model(model, out, args.format, input_size=size, in_chans=cfg.get("in_chans") or 3,
                       check=not args.no_check, batch_size=args.batch_size, dynamic_batch=not args.static_batch)
    shape = (["batch"] if res["dynamic_batch"] else []) + res["input_shape"][1 if res["dynamic_batch"] else 0:]
    batches = " and ".join(map(str, res["check_batches"]))
    if res["checked"]:
        against = "ONNX Runtime" if args.format == "onnx" else "reloaded"
        check = (f"check passed at batch {batches} ({against} vs eager): max abs error {res['max_abs_error']:.3g} "
                 f"<= tolerance {res['tolerance']:.3g}")
    else:
        check = "check skipped"
    print(f"{res['path']}: {args.format} {res['dtype']}, input [{', '.join(map(str, shape))}]; {check}")
    if res["external_data"]:
        print(f"{res['path']}: the weights are too large for one .onnx file (2 GB protobuf limit) and are in "
              f"{res['external_data']}, which must stay next to it")
    return 0


def _add_demo(sub) -> None:
    """``lambdanet demo``"""
    demo = sub.add_parser("demo", help="run one lambda layer forward and backward on random data",
                          description="Build a LambdaLayer, run it forward and backward on a random [batch, dim, "
                                      "size, size] input, and print the layer, its output shape, parameter count, "
                                      "time and the position implementation it chose.",
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    demo.add_argument("--dim", type=int, default=64, help="input and output channels d")
    demo.add_argument("--dim-k", type=int, default=16, help="query/key depth |k|")
    demo.add_argument("--heads", type=int, default=4, help="queries per lambda |h| (must divide --dim)")
    demo.add_argument("--r", type=int, default=23, help="local scope |r| of the lambda convolution (odd)")
    demo.add_argument("--size", type=int, default=16, help="input height and width")
    demo.add_argument("--batch", type=int, default=8, help="batch size")
    demo.set_defaults(func=_cmd_demo)


def _add_models(sub) -> None:
    """``lambdanet models``"""
    models = sub.add_parser("models", help="list models with params, FLOPs and input size",
                            description="Every registered model with its parameters (1000 classes), FLOPs "
                                        "(torch.utils.flop_counter, one image at the default input size) and input "
                                        "size; --paper compares the papers' tables instead.")
    models.add_argument("pattern", nargs="?", default=None,
                        help="shell-style filter on model names, e.g. 'lambda_resnet*' (with --paper: rows whose "
                             "model matches, or a table number such as 13)")
    models.add_argument("--paper", action="store_true", help="compare with the papers' parameter/FLOP tables")
    models.add_argument("--no-flops", action="store_true", help="skip FLOP counting (faster)")
    models.add_argument("--pretrained", action="store_true",
                        help="only the models with published ImageNet weights (create_model(name, pretrained=True)), "
                             "with their hub ids and accuracy")
    models.set_defaults(func=_cmd_models)


def _cmd_detect(args: argparse.Namespace) -> int:
    """Train and evaluate a detector (library: ``lambdanet.detection.trainer.train_detector``)."""
    from lambdanet.detection.trainer import DetectConfig, resolve_detect_config, train_detector
    from lambdanet.train.config import load_yaml

    names = {f.name for f in dataclasses.fields(DetectConfig)}
    overrides = {k: v for k, v in vars(args).items() if k in names and v is not None}
    yaml_values = load_yaml(args.config) if args.config else {}
    train_detector(resolve_detect_config(overrides.get("recipe"), yaml_values, overrides))
    return 0


def _add_detect(sub) -> None:
    """``lambdanet detect``"""
    from lambdanet.detection.trainer import DETECT_CHOICES, DETECT_RECIPES, DetectConfig, recipe_values
    from lambdanet.train.config import add_config_arguments

    detect = sub.add_parser(
        "detect", help="train and evaluate Mask R-CNN / Faster R-CNN on a lambda, halo or convolution backbone",
        description=f"Detection and instance segmentation (LambdaNetworks Table 6, HaloNet Table 5): torchvision's "
                    f"Mask R-CNN on an FPN over a registered backbone. Recipes: {', '.join(DETECT_RECIPES)} (paper: "
                    "App. E.2's 1024 px COCO recipe). Data: glyphs (built-in offline scenes) or coco:DIR. "
                    "Evaluation: COCO box and mask AP with pycocotools, in summary.json. Every option is also a YAML "
                    "key (--config); --resume continues the run in --out; under torchrun it trains with "
                    "DistributedDataParallel.")
    detect.add_argument("--config", help="YAML file of options")
    add_config_arguments(detect, DetectConfig, DETECT_CHOICES, recipe_values())
    detect.set_defaults(func=_cmd_detect)


def _add_train(sub) -> None:
    """``lambdanet train``"""
    from lambdanet.data import list_datasets
    from lambdanet.train.config import RECIPES, add_config_arguments

    recipes = ", ".join(RECIPES)
    train = sub.add_parser(
        "train", help="train and evaluate a model",
        description=f"Train and evaluate. Recipes: {recipes}. Data: {', '.join(list_datasets())}. Every option is "
                    "also a YAML key (--config FILE); precedence: defaults < --recipe < --config < flags. "
                    "--resume continues the run in --out where it stopped. --checkpoint RUN_OR_FILE fine-tunes a "
                    "run's model (its architecture and image size unless given) or timm's weights, adapting the "
                    "input channels and the classifier to the data. Under torchrun the same command trains "
                    "with DistributedDataParallel.")
    train.add_argument("--config", help="YAML file of options")
    add_config_arguments(train)
    train.set_defaults(func=_cmd_train)


def _add_eval(sub) -> None:
    """``lambdanet eval``"""
    ev = sub.add_parser("eval", help="evaluate a checkpoint",
                        description="Top-1/top-5 accuracy and loss of a training checkpoint (its EMA weights when it "
                                    "has them) on its dataset or another one.")
    ev.add_argument("--checkpoint", required=True,
                    help="a run directory of lambdanet train or its last.pt (the training checkpoint)")
    ev.add_argument("--data", default=None, help="dataset (default: the checkpoint's)")
    ev.add_argument("--data-dir", default=None, help="dataset folder (default: the checkpoint's)")
    ev.add_argument("--split", default="test", choices=["test", "train"], help="split to evaluate (default: test)")
    ev.add_argument("--batch-size", type=int, default=256, help="evaluation batch size (default: 256)")
    ev.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                    help="device (default: auto = CUDA when available)")
    ev.add_argument("--no-ema", action="store_true", help="use the raw weights even if an EMA exists")
    ev.add_argument("--json", action="store_true", help="print the result as JSON")
    ev.set_defaults(func=_cmd_eval)


def _add_sweep(sub) -> None:
    """``lambdanet sweep``"""
    sw = sub.add_parser("sweep", help="learning-rate sensitivity study",
                        description="Train the same recipe at several learning rates (and models) into "
                                    "--out/<model>/lr_<lr>; writes sweep.md, sweep.json and sweep.png (accuracy vs "
                                    "learning rate) into --out. Rerunning reuses finished runs of the same resolved "
                                    "configuration and resumes unfinished ones; a run folder holding another "
                                    "configuration is refused. Every train option applies.")
    sw.add_argument("--lrs", type=float, nargs="+", required=True, help="learning rates")
    sw.add_argument("--models", nargs="+", default=None, help="models (default: --model)")
    sw.add_argument("--config", help="YAML file of options")
    from lambdanet.train.config import add_config_arguments

    add_config_arguments(sw)
    sw.set_defaults(func=_cmd_sweep)


def _add_pseudo_label(sub) -> None:
    """``lambdanet pseudo-label``"""
    ps = sub.add_parser("pseudo-label", help="label a teacher's unlabelled images",
                        description="Label the unlabelled part (1 - labeled_fraction) of a teacher run's training "
                                    "set; train a student with --labeled-fraction F --pseudo-labels FILE.")
    ps.add_argument("--checkpoint", required=True, help="the teacher's last.pt (trained with --labeled-fraction < 1)")
    ps.add_argument("--out", required=True, help="output file (.pt)")
    ps.add_argument("--threshold", type=float, default=0.0, help="keep labels with at least this confidence")
    ps.set_defaults(func=_cmd_pseudo)


def _add_bench(sub) -> None:
    """``lambdanet bench``"""
    from lambdanet.bench.layer_bench import LAYER_SUITE, TARGET_POINTS
    from lambdanet.bench.model_bench import MODEL_SUITES
    from lambdanet.bench.peers import INSTALL_HINT
    from lambdanet.bench.runner import DEFAULT_PARTS, DEFAULT_SUITES, PARTS
    from lambdanet.runtime import AMP_DTYPES

    points = "; ".join(f"B={b} C={c} {n}x{n} {'global' if r is None else f'{r}x{r}'}"
                       for b, c, n, r in TARGET_POINTS)
    bench = sub.add_parser(
        "bench", help="speed / memory / FLOPs benchmarks against the baselines and peers",
        description=f"Parts: targets (LambdaLayer, k=16 h=4, forward+backward against timm and lucidrains "
                    f"lambda-networks at {points}; with the Triton kernels as their own row on CUDA), impls (every "
                    "LambdaLayer position implementation at batch 64-256, 14x14 and 28x28, scopes 7, 23 and global: "
                    "the fastest and auto's pick), attention (HaloNet and global relative attention against "
                    "timm's HaloAttn and BottleneckAttn), scaling (Table 4 layers across resolutions: time, memory, "
                    "FLOPs, log-log slopes and plots), models (Table 13/14 suites, HaloNet, MobileNet, the 26-layer "
                    "hybrid: img/s, memory, params, FLOPs), table4 (Table 4's memory column from the complexity "
                    "formulas). Writes CSV, JSON, PNG plots and bench.md into --out. The peers come with the bench "
                    f"extra ({INSTALL_HINT}); without it their rows are left out, with a warning.")
    bench.add_argument("parts", nargs="*", default=None, metavar="part",
                       help=f"parts to run, among {', '.join(PARTS)} (default: {' '.join(DEFAULT_PARTS)})")
    bench.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                       help="device to measure on: cpu or cuda (default: %(default)s)")
    bench.add_argument("--out", default="bench_results",
                       help="folder receiving <part>.csv/.json, the plots and bench.md (default: %(default)s)")
    bench.add_argument("--quick", action="store_true", help="tiny sizes and few repeats: a smoke test of the harness")
    bench.add_argument("--suites", nargs="+", default=list(DEFAULT_SUITES), choices=list(MODEL_SUITES),
                       metavar="SUITE", help=f"models part: suites among {', '.join(MODEL_SUITES)} "
                                             f"(default: {' '.join(DEFAULT_SUITES)})")
    bench.add_argument("--img-size", type=int, default=224,
                       help="models part: input resolution (default: %(default)s)")
    bench.add_argument("--batch-size", type=int, default=8,
                       help="models part: batch size, halved on out-of-memory (default: %(default)s)")
    bench.add_argument("--repeats", type=int, default=5,
                       help="targets and attention parts: timed rounds per implementation (default: %(default)s)")
    bench.add_argument("--layers", nargs="+", default=None, metavar="LAYER",
                       help=f"scaling part: layers to sweep, among {', '.join(LAYER_SUITE)} (default: all)")
    bench.add_argument("--amp", default="none", choices=list(AMP_DTYPES),
                       help=f"models part: autocast precision, one of {', '.join(AMP_DTYPES)} (fp16 needs --device "
                            "cuda; default: %(default)s)")
    bench.add_argument("--channels-last", action="store_true", help="models part: channels_last model and input")
    bench.add_argument("--compile", action="store_true",
                       help="models part: time torch.compile(model) (compilation is in the untimed warm-up)")
    bench.set_defaults(func=_cmd_bench)


def _add_predict(sub) -> None:
    """``lambdanet predict``"""
    from lambdanet.predict import DTYPES, IMAGE_SUFFIXES

    pr = sub.add_parser("predict", help="classify image files",
                        description="Top-k classes of image files with a trained run (--checkpoint) or a model's "
                                    "published weights (--model NAME --pretrained), preprocessed as the model's "
                                    f"pretrained_cfg says. A folder stands for every {'/'.join(IMAGE_SUFFIXES)} "
                                    "file under it (recursively, sorted).")
    pr.add_argument("images", nargs="+", metavar="IMAGE", help="image files or folders of images")
    pr.add_argument("--model", default=None, help="registered model name (with --pretrained; with --checkpoint "
                                                   "optional: it must be the run's model)")
    pr.add_argument("--pretrained", action="store_true", help="use the model's published weights")
    pr.add_argument("--checkpoint", default=None,
                    help="a run directory, its .safetensors weights or its last.pt (lambdanet train); with --model, "
                         "a weights file of that model (timm's checkpoint or lambdanet's own)")
    pr.add_argument("--top-k", type=int, default=5, help="classes shown per image (default: %(default)s)")
    pr.add_argument("--json", action="store_true", help="print the predictions as JSON")
    pr.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                    help="device (default: auto = CUDA when available)")
    pr.add_argument("--dtype", default="float32", metavar="DTYPE",
                    help=f"precision the model runs in, one of {', '.join(DTYPES)} (default: %(default)s; float16 "
                         "is slow on a CPU)")
    pr.set_defaults(func=_cmd_predict)


def _add_export(sub) -> None:
    """``lambdanet export``"""
    from lambdanet.export import FORMAT_DTYPES, FORMATS, ONNX_INSTALL, SUFFIXES

    ex = sub.add_parser("export", help="export a model to ONNX, TorchScript or a torch.export program",
                        description="Write a model (--model NAME, random or --pretrained weights, or a trained "
                                    "--checkpoint) as ONNX (dynamo exporter, one self-contained .onnx file unless "
                                    "the weights exceed 1.5 GB, checked with ONNX Runtime; needs "
                                    f"{ONNX_INSTALL}), TorchScript (torch.jit.trace) or an ExportedProgram "
                                    "(torch.export, .pt2), for inputs [batch, C, N, N] of any batch (traced at "
                                    "batch 2; --static-batch: the traced batch only), then load it back and "
                                    "compare it with the eager model at batch 1 and at the traced batch + 1.")
    ex.add_argument("--model", default=None, help="registered model name")
    ex.add_argument("--pretrained", action="store_true", help="with --model: its published weights")
    ex.add_argument("--checkpoint", default=None,
                    help="a run directory, its .safetensors weights or its last.pt (lambdanet train); with --model, "
                         "a weights file of that model (timm's checkpoint or lambdanet's own)")
    ex.add_argument("--format", required=True, metavar="FORMAT", help=f"one of {', '.join(FORMATS)}")
    ex.add_argument("--out", default=None,
                    help="output file (default: <model>" + "|".join(SUFFIXES.values()) + " in this folder)")
    ex.add_argument("--img-size", type=int, default=None,
                    help="input height and width (default: the model's pretrained_cfg or paper input size)")
    ex.add_argument("--num-classes", type=int, default=None, help="with --model: classifier outputs")
    ex.add_argument("--no-check", action="store_true", help="skip loading the export back and comparing")
    ex.add_argument("--dtype", default="float32", metavar="DTYPE",
                    help="precision of the exported model and its input: " + "; ".join(
                        f"{f}: {', '.join(d)}" for f, d in FORMAT_DTYPES.items()) + " (default: %(default)s)")
    ex.add_argument("--static-batch", action="store_true",
                    help="export for the traced batch only (default: any batch)")
    ex.add_argument("--batch-size", type=int, default=None,
                    help="batch the export is traced on (default: 2; 1 with --static-batch)")
    ex.set_defaults(func=_cmd_export)


def build_parser() -> argparse.ArgumentParser:
    from lambdanet import __version__

    parser = argparse.ArgumentParser(prog="lambdanet", description=DESCRIPTION,
                                     epilog="Run 'lambdanet COMMAND --help' for a command's options.")
    parser.add_argument("--version", action="version", version=f"lambdanet {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="command")
    parser.commands = sub.choices  # name -> subparser, for errors in a command's own usage

    for add in (_add_demo, _add_models, _add_train, _add_eval, _add_sweep, _add_pseudo_label, _add_predict,
                _add_export, _add_detect, _add_bench):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # a mistyped option: the subcommand's usage, not the top-level one
        where = parser.commands.get(getattr(args, "command", None), parser)
        where.error(f"unrecognized arguments: {' '.join(extra)} (see 'lambdanet {args.command or ''} --help')")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from lambdanet.train.preempt import Preempted, exit_status

    try:
        return int(args.func(args) or 0)
    except Preempted as err:  # a checkpoint was saved: one line, and the signal's conventional exit status
        print(f"lambdanet {args.command}: {err}", file=sys.stderr)
        return exit_status(err)
    except _user_errors() as err:
        print(f"lambdanet {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
