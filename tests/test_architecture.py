"""The package's structure (docs/architecture.md): dependencies point down the stack and no module imports
itself back through others, function-level (lazy) imports included; each shared constant and primitive is
defined once."""

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lambdanet"

# the stack, bottom first: a module may import its own level and the ones below it
LEVELS = [
    ("lambdanet.constants", "lambdanet.files", "lambdanet.helpers", "lambdanet.runtime"),
    ("lambdanet.functional", "lambdanet.kernels", "lambdanet.ops"),
    ("lambdanet.layers",),
    ("lambdanet.models",),
    ("lambdanet.engine",),
    # the tasks (lambdanet/tasks/<task>/) and, for one release, their old import paths
    ("lambdanet.tasks", "lambdanet.tasks.classification", "lambdanet.tasks.lm"),
    ("lambdanet.data", "lambdanet.train", "lambdanet.lm"),
    # detection: targets <- coco <- glyphs <- data; its backbone pre-training is a classification run
    ("lambdanet.tasks.detection", "lambdanet.detection", "lambdanet.predict", "lambdanet.export", "lambdanet.hub"),
    ("lambdanet.bench",),
    ("lambdanet.cli", "lambdanet.__main__"),
]


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts).removesuffix(".__init__")] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports anywhere in its body. ``from pkg import name`` counts as an
    import of ``pkg.name`` when that is a module, else of ``pkg`` (its ``__init__``)."""
    mods = modules()
    graph = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                subs = {f"{base}.{a.name}" for a in node.names} & set(mods)
                deps.update(subs or {base})
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph


def level(module: str) -> int | None:
    """The level of the longest prefix naming ``module`` (``lambdanet.tasks.detection`` before
    ``lambdanet.tasks``)."""
    found = [(len(p), i) for i, prefixes in enumerate(LEVELS) for p in prefixes
             if module == p or module.startswith(p + ".")]
    return max(found)[1] if found else None


def test_every_module_has_a_level_and_imports_only_its_own_or_lower():
    graph = import_graph()
    unplaced = sorted(m for m in graph if m != "lambdanet" and level(m) is None)
    assert not unplaced, f"modules outside the stack (add them to LEVELS and docs/architecture.md): {unplaced}"
    upward = sorted(f"{m} -> {d}" for m, deps in graph.items() if m != "lambdanet"
                    for d in deps if d != "lambdanet" and level(d) > level(m))
    assert not upward, upward


def test_no_import_cycle():
    """Tarjan's strongly connected components of the import graph: all of size one."""
    graph = import_graph()
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, cycles


@pytest.mark.parametrize("pattern, what", [
    (r"^(\s*)(def|class) (make_divisible|conv_norm_act|ConvNormAct|BatchNormAct|get_act)\b",
     "conv-norm-act primitives"),
    (r"\{\s*\"relu\":\s*nn\.ReLU\b", "the activations by name"),
    (r"0\.485,\s*0\.456,\s*0\.406", "ImageNet's mean"),
    (r"0\.229,\s*0\.224,\s*0\.225", "ImageNet's std"),
    (r"^\s*METADATA_FORMAT\s*=", "the run-weights header format"),
    (r"^(\s*)def (run_file|read_state_dict|read_safetensors|_read_safetensors)\b", "reading weight files"),
    (r"^class PretrainedCfg\b", "the preprocessing metadata type"),
    # the training engine (issue 25): one of each for every task
    (r"^(\s*)(class|def) (RunState|RunConfig|RunDirLock|check_new_run|build_optimizer|lr_at|data_parallel|"
     r"optimizer_step|train_epoch|fit|check_resume|add_config_arguments|config_source_from_args)\b",
     "the run state, configuration, loop, optimizer and schedule, DDP wrap and run-directory rule"),
    (r"^\s*for .* in enumerate\(.*batches", "the training loop over batches"),
])
def test_each_shared_piece_is_defined_once(pattern, what):
    found = [f"{path.relative_to(PACKAGE.parent)}:{i}" for path in sorted(PACKAGE.rglob("*.py"))
             for i, line in enumerate(path.read_text().splitlines(), 1) if re.search(pattern, line)]
    # each match must define another name: the name a def / class pattern captures (its last group), else the
    # pattern's one piece (the last word of the match let two loops over differently named batches pass)
    names = {m.group(m.re.groups) if m.re.groups else what for path in PACKAGE.rglob("*.py")
             for line in path.read_text().splitlines() if (m := re.search(pattern, line))}
    assert len(found) == len(names) >= 1, f"{what} defined in {found}"


def test_no_function_body_is_longer_than_60_lines():
    """Short hot paths: every function's code (its docstring aside) fits in 60 lines."""
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = node.body
                docstring = (isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant)
                             and isinstance(body[0].value.value, str))
                start = body[0].end_lineno + 1 if docstring else body[0].lineno
                if node.end_lineno - start + 1 > 60:
                    long.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}")
    assert not long, long


def test_options_the_tasks_share_are_declared_once():
    """An option several tasks have means one thing: the same closed choices and the same rule for --resume
    (issue 25); those in SHARED_OPTIONS take them from there, and every optimizer offered builds."""
    import dataclasses

    import torch

    from lambdanet.engine.config import SHARED_OPTIONS
    from lambdanet.engine.optim import build_optimizer
    from lambdanet.tasks.classification.config import TrainConfig
    from lambdanet.tasks.detection.config import DetectConfig
    from lambdanet.tasks.lm.config import LMConfig

    seen: dict[str, tuple] = {}
    for cls in (TrainConfig, DetectConfig, LMConfig):
        for f in dataclasses.fields(cls):
            rule = (f.metadata["choices"], f.metadata["resume_free"])
            if f.name in SHARED_OPTIONS:
                assert rule == SHARED_OPTIONS[f.name][1:], (cls.__name__, f.name)
            assert seen.setdefault(f.name, rule) == rule, (cls.__name__, f.name, seen[f.name], rule)
    for name in SHARED_OPTIONS["optimizer"][1]:
        opt = build_optimizer(torch.nn.Linear(2, 2), name=name, lr=0.1, weight_decay=0.0)
        assert opt.defaults["lr"] == 0.1, name


def test_the_engine_knows_no_task_metric():
    """The engine runs every task alike: a task's metrics (classification's top-k, a language model's bits per
    byte, detection's AP) are named in the task's module, never in lambdanet/engine."""
    pattern = re.compile(r"top[15]|bits_per_byte|box_ap|mask_ap|\bap\b", re.IGNORECASE)
    found = [f"{path.relative_to(PACKAGE.parent)}:{i}" for path in sorted((PACKAGE / "engine").rglob("*.py"))
             for i, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, found


def test_no_module_is_longer_than_450_lines():
    """One concern per module (issue 38): every module of the package fits in 450 lines."""
    long = [f"{path.relative_to(PACKAGE.parent)} ({n})" for path in sorted(PACKAGE.rglob("*.py"))
            if (n := len(path.read_text().splitlines())) > 450]
    assert not long, long


TASKS = PACKAGE / "tasks"


def test_the_task_folders_have_the_same_files_for_the_same_concerns():
    """Every task is laid out alike (docs/architecture.md, "how to add a task"): its configuration and recipes in
    config.py, its data in data.py, its engine Task in task.py, each defining what the engine needs there."""
    folders = sorted(p for p in TASKS.iterdir() if p.is_dir() and (p / "__init__.py").is_file())
    assert [p.name for p in folders] == ["classification", "detection", "lm"]
    from lambdanet.engine.config import RunConfig
    from lambdanet.engine.contract import Task
    import importlib
    import inspect
    for folder in folders:
        assert all((folder / f).is_file() for f in ("__init__.py", "config.py", "data.py", "task.py")), folder.name
        config = importlib.import_module(f"lambdanet.tasks.{folder.name}.config")
        task = importlib.import_module(f"lambdanet.tasks.{folder.name}.task")
        configs = [c for _, c in inspect.getmembers(config, inspect.isclass)
                   if issubclass(c, RunConfig) and c is not RunConfig and c.__module__ == config.__name__]
        tasks = [c for _, c in inspect.getmembers(task, inspect.isclass)
                 if issubclass(c, Task) and c is not Task and c.__module__ == task.__name__]
        assert configs and tasks, folder.name
        assert all(not inspect.isabstract(t) for t in tasks), folder.name


def test_the_engine_names_no_task():
    """The engine serves every task alike (issue 38): no task's name, module or configuration class in
    lambdanet/engine, docstrings and comments included."""
    pattern = re.compile(r"classif|detect|language model|lambdanet\.(train|lm|data|tasks)\b|\blm\b|TrainConfig|"
                         r"DetectConfig|LMConfig|glyph|top-?[15]", re.IGNORECASE)
    found = [f"{path.relative_to(PACKAGE.parent)}:{i}: {line.strip()}"
             for path in sorted((PACKAGE / "engine").rglob("*.py"))
             for i, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, found
