"""Sharing trained models: push_to_hub / create_model("hf-hub:...") / load_model("hf-hub:...") and hubconf.py,
without network: the repository push_to_hub writes is placed in huggingface_hub's own cache layout (a temporary
cache, offline mode), so loading goes through huggingface_hub exactly as after a real download; the upload goes
to a recording stand-in for ``HfApi``. The expectation is the run's own model: logits bit-equal, same
preprocessing and classes."""

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import huggingface_hub
import huggingface_hub.constants
import pytest
import torch

import lambdanet
from lambdanet import create_model, load_model
from lambdanet.hub import push_to_hub, save_for_hub

REPO = Path(__file__).resolve().parent.parent
RUN = REPO / "tests" / "fixtures" / "runs_v1" / "train_done"  # written by lambdanet 0.1.0


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty huggingface_hub cache in offline mode; ``publish(folder, repo_id)`` puts a repository in it as a
    download would (``models--owner--name/snapshots/<commit>/`` and ``refs/main``)."""
    cache = tmp_path / "hf_cache"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)

    def publish(folder: Path, repo_id: str) -> None:
        commit = "0123456789abcdef0123456789abcdef01234567"
        root = cache / f"models--{repo_id.replace('/', '--')}"
        shutil.copytree(folder, root / "snapshots" / commit)
        (root / "refs").mkdir(parents=True)
        (root / "refs" / "main").write_text(commit)

    return publish


def test_a_run_shared_and_loaded_back_gives_its_own_logits(tmp_path, hub_cache):
    folder = save_for_hub(RUN, tmp_path / "repo")
    assert {p.name for p in folder.iterdir()} == {"model.safetensors", "config.json", "README.md", "summary.json",
                                                  "config.yaml"}
    hub_cache(folder, "someone/digits-resnet26")
    own = load_model(RUN)
    x = torch.randn(4, 1, 16, 16)
    for shared in (create_model("hf-hub:someone/digits-resnet26").eval(),
                   load_model("hf-hub:someone/digits-resnet26")):
        assert torch.equal(shared(x), own(x))
        for key in ("architecture", "num_classes", "input_size", "mean", "std", "classes", "data"):
            assert shared.pretrained_cfg[key] == own.pretrained_cfg[key], key
        assert shared.pretrained_cfg["weights"] == "hf-hub:someone/digits-resnet26"
    config = json.loads((folder / "config.json").read_text())
    assert config["architecture"] == "resnet26" and config["pretrained_cfg"]["input_size"] == [1, 16, 16]
    assert config["model_args"] == json.loads((RUN / "summary.json").read_text())["model_kwargs"]


def test_the_model_card_renders_the_runs_metrics_and_how_to_load_it(tmp_path):
    summary = json.loads((RUN / "summary.json").read_text())
    card = (save_for_hub(RUN, tmp_path / "repo") / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: lambdanet\n")
    assert f"| test top-1 | {summary['final_acc']:.2%} |" in card
    assert f"| parameters | {summary['params']:,} |" in card and "lambdanet train --config config.yaml" in card
    assert 'create_model("hf-hub:OWNER/NAME")' in card
    named = (save_for_hub(RUN, tmp_path / "named", "you/digits") / "README.md").read_text()  # push-to-hub --folder
    assert 'create_model("hf-hub:you/digits")' in named and "OWNER/NAME" not in named
    lm_card = (save_for_hub(LM_RUN, tmp_path / "lm", "you/lm") / "README.md").read_text()
    assert 'create_model("hf-hub:you/lm")' in lm_card and "OWNER/NAME" not in lm_card
    for bad in ("noslash", "a/b/c", "/name", "owner/", "me/bad name", "me/a--b", "me/-a", "me/a.", "me/" + "x" * 97):
        with pytest.raises(ValueError, match=r"^repo_id must be 'owner/name' \(letters, .*, got '"):
            save_for_hub(RUN, tmp_path / "bad", bad)
    for good in ("me/a.b-c_d", "Me_9/" + "x" * 96):  # the hub's own rule (huggingface_hub's validate_repo_id)
        save_for_hub(RUN, tmp_path / "good" / good.split("/")[0], good)


def test_the_repository_folder_never_overwrites_the_run_or_other_files(tmp_path):
    """``--folder`` must not be the run directory (its ``model.safetensors`` would be replaced by the EMA weights
    that the repository takes) nor a folder holding other files; an earlier repository folder is rewritten."""
    run = tmp_path / "run"
    shutil.copytree(RUN, run)
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    with pytest.raises(ValueError, match=r"^folder .*run is the run directory itself: pass another folder"):
        save_for_hub(run, run)
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before
    mine = tmp_path / "project"
    mine.mkdir()
    (mine / "README.md").write_text("my project")
    (mine / "config.json").write_text('{"mine": 1}')
    with pytest.raises(ValueError, match=r"^folder .*project is not empty and is not a repository \(README.md, "
                                         r"config.json\): pass a new or empty folder"):
        save_for_hub(RUN, mine)
    assert (mine / "README.md").read_text() == "my project"
    repo = save_for_hub(RUN, tmp_path / "repo")
    (repo / "README.md").write_text("stale")
    assert save_for_hub(RUN, repo, "you/digits") == repo and "you/digits" in (repo / "README.md").read_text()
    (repo / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"holds other files than lambdanet's repository \(notes.txt\)"):
        save_for_hub(RUN, repo)
    clone = tmp_path / "clone"  # git clone of an empty hub repository, and again after the first upload
    (clone / ".git").mkdir(parents=True)
    (clone / ".gitattributes").write_text("*.safetensors filter=lfs")
    assert (save_for_hub(RUN, clone) / "model.safetensors").is_file()
    assert save_for_hub(RUN, clone) == clone and (clone / ".gitattributes").read_text().startswith("*.safetensors")


def test_a_repository_folder_used_again_keeps_no_file_of_the_earlier_source(tmp_path):
    """A folder (or a clone of the hub repository) written for a run, then for a model object: the run's
    ``summary.json`` and ``config.yaml`` go, and the card no longer says the model was trained with them."""
    repo = save_for_hub(RUN, tmp_path / "repo")
    assert {"summary.json", "config.yaml"} <= {p.name for p in repo.iterdir()}
    save_for_hub(create_model("resnet26", num_classes=3, base_width=4), repo)
    assert {p.name for p in repo.iterdir()} == {"model.safetensors", "config.json", "README.md"}
    card = (repo / "README.md").read_text()
    assert "config.yaml" not in card and "test top-1" not in card
    assert json.loads((repo / "config.json").read_text())["num_classes"] == 3


def test_a_stopped_run_or_a_missing_path_is_said_to_be_so(tmp_path, capsys):
    """A run that stopped before its end (its ``last.pt`` only) or a path that does not exist: said so in one
    line, not "not the weights of a lambdanet train run"."""
    from lambdanet.cli import main

    stopped = tmp_path / "stopped"
    shutil.copytree(RUN, stopped)
    for weights in stopped.glob("*.safetensors"):
        weights.unlink()
    with pytest.raises(ValueError, match=r"stopped before its end holds only its training checkpoint \(last.pt\); "
                                         r"finish it with --resume"):  # fmt: skip
        save_for_hub(stopped, tmp_path / "repo")
    with pytest.raises(ValueError, match=r"last.pt is a training checkpoint; pass its run directory or the run's "):
        save_for_hub(RUN / "last.pt", tmp_path / "repo")  # a finished run's, given by name: not "stopped"
    assert main(["push-to-hub", str(tmp_path / "gone"), "me/x", "--folder", str(tmp_path / "repo")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{tmp_path / 'gone'} does not exist; pass a run directory" in err
    assert not (tmp_path / "repo").exists()


def test_a_model_object_is_shared_with_its_arguments(tmp_path, hub_cache):
    torch.manual_seed(1)
    model = create_model("resnet26", num_classes=3, in_chans=2, base_width=4, stem="cifar").eval()
    model.pretrained_cfg["interpolation"] = "bicubic"  # (as timm's ImageNet weights of lambda_resnet26t say)
    hub_cache(save_for_hub(model, tmp_path / "repo"), "someone/tiny")
    shared = create_model("hf-hub:someone/tiny").eval()
    x = torch.randn(2, 2, 32, 32)
    assert shared.model_kwargs == {"base_width": 4, "stem": "cifar"} and torch.equal(shared(x), model(x))
    # its preprocessing too (crop_pct 0.875 and bicubic were 1.0 and bilinear, a run's on built-in data)
    for key in ("input_size", "mean", "std", "crop_pct", "interpolation", "classes"):
        assert shared.pretrained_cfg[key] == model.pretrained_cfg[key], key
    fresh_head = create_model("hf-hub:someone/tiny", num_classes=5)  # fine-tuning: the trunk shared, a new head
    first = model.pretrained_cfg["first_conv"]
    assert fresh_head.fc.out_features == 5
    assert torch.equal(dict(fresh_head.named_modules())[first].weight, dict(model.named_modules())[first].weight)


LM_RUN = REPO / "tests" / "fixtures" / "lm_runs_fixed" / "lm_done"  # a lambdanet lm train run


def test_a_language_model_run_shared_and_loaded_back_gives_its_own_logits(tmp_path, hub_cache):
    folder = save_for_hub(LM_RUN, tmp_path / "repo")
    assert {p.name for p in folder.iterdir()} == {"model.safetensors", "config.json", "README.md", "summary.json",
                                                  "config.yaml"}
    hub_cache(folder, "someone/tiny-lm")
    own = load_model(LM_RUN)  # the run's own model, through lambdanet.tasks.lm's loader
    tokens = torch.tensor([list(b"def f(x):")])
    for shared in (create_model("hf-hub:someone/tiny-lm").eval(), load_model("hf-hub:someone/tiny-lm")):
        assert torch.equal(shared(tokens), own(tokens))
    summary = json.loads((LM_RUN / "summary.json").read_text())
    config = json.loads((folder / "config.json").read_text())
    assert (config["architecture"], config["vocab_size"], config["model_args"]) == (
        summary["model"], summary["vocab_size"], summary["model_kwargs"])
    card = (folder / "README.md").read_text()
    assert f"| validation bits per byte | {summary['val_bits_per_byte']:.4f} |" in card
    assert "lambdanet lm train --config config.yaml" in card and 'create_model("hf-hub:OWNER/NAME")' in card


def test_lm_sample_continues_a_prompt_with_a_shared_language_model(tmp_path, hub_cache, capsys):
    """``lambdanet lm sample --checkpoint hf-hub:...`` samples what the run itself samples (same weights, seed and
    prompt); an image model's repository is refused naming it, and another ``vocab_size`` than the weights' is a
    one-line error, not torch's size mismatch."""
    from lambdanet.cli import main

    hub_cache(save_for_hub(LM_RUN, tmp_path / "lm"), "someone/tiny-lm")
    hub_cache(save_for_hub(RUN, tmp_path / "img"), "someone/digits")
    argv = ["lm", "sample", "--prompt", "def f(", "--max-new-tokens", "12", "--seed", "3"]
    assert main([*argv, "--checkpoint", str(LM_RUN)]) == 0
    own = capsys.readouterr().out
    assert main([*argv, "--checkpoint", "hf-hub:someone/tiny-lm"]) == 0
    assert capsys.readouterr().out == own and own.startswith("def f(") and len(own.encode()) >= len("def f(") + 1
    assert main([*argv, "--checkpoint", "hf-hub:someone/digits"]) == 2
    err = capsys.readouterr().err
    assert err == "lambdanet lm sample: error: hf-hub:someone/digits is not a language model written by lambdanet " \
                  "lm train\n"
    vocab = create_model("hf-hub:someone/tiny-lm").vocab_size
    with pytest.raises(ValueError, match=rf"^vocab_size={vocab + 1} does not fit hf-hub:someone/tiny-lm, trained "
                                         rf"with vocab_size={vocab} \(leave it out: the repository's is used\)$"):
        create_model("hf-hub:someone/tiny-lm", vocab_size=vocab + 1)
    assert create_model("hf-hub:someone/tiny-lm", vocab_size=vocab).vocab_size == vocab  # the same one: fine


def test_predict_export_and_eval_take_a_shared_run(tmp_path, hub_cache, capsys):
    """``predict --checkpoint hf-hub:...`` prints what the run itself predicts (its classes and preprocessing come
    with the weights); ``export`` writes the same model; ``eval`` (which needs a training checkpoint, not on the
    hub) and ``predict`` of a shared language model are one line each, saying what to use instead."""
    from PIL import Image

    from lambdanet.cli import main

    hub_cache(save_for_hub(RUN, tmp_path / "img"), "someone/digits")
    hub_cache(save_for_hub(LM_RUN, tmp_path / "lm"), "someone/tiny-lm")
    image = tmp_path / "seven.png"
    Image.fromarray((torch.rand(20, 20) * 255).to(torch.uint8).numpy(), mode="L").save(image)
    assert main(["predict", str(image), "--checkpoint", str(RUN), "--json"]) == 0
    own = json.loads(capsys.readouterr().out)
    assert main(["predict", str(image), "--checkpoint", "hf-hub:someone/digits", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == own
    out = tmp_path / "digits.pt"
    assert main(["export", "--checkpoint", "hf-hub:someone/digits", "--format", "torchscript", "--out", str(out)]) == 0
    printed = capsys.readouterr().out  # the file loaded back against the shared model, within export's tolerance
    channels, size = load_model(RUN).pretrained_cfg["input_size"][:2]
    assert printed.startswith(f"{out}: torchscript float32, input [batch, {channels}, {size}, {size}]; check passed")
    assert main(["eval", "--checkpoint", "hf-hub:someone/digits"]) == 2
    assert capsys.readouterr().err == (
        "lambdanet eval: error: hf-hub:someone/digits holds weights without a training checkpoint; evaluate the run "
        "that wrote it, or classify images with lambdanet predict --checkpoint hf-hub:someone/digits\n"
    )
    assert main(["pseudo-label", "--checkpoint", "hf-hub:someone/digits", "--out", str(tmp_path / "p.pt")]) == 2
    assert capsys.readouterr().err == (
        "lambdanet pseudo-label: error: hf-hub:someone/digits holds weights without a training checkpoint; "
        "pseudo-label with the run that wrote it (its directory or last.pt)\n"
    )
    assert main(["predict", str(image), "--checkpoint", "hf-hub:someone/tiny-lm"]) == 2
    assert capsys.readouterr().err == (
        "lambdanet predict: error: hf-hub:someone/tiny-lm is a language model (lambdanet lm train), not an image "
        "classifier; continue a prompt with lambdanet lm sample --checkpoint hf-hub:someone/tiny-lm\n"
    )


def test_hub_names_take_a_revision_with_slashes():
    """A revision (``@v1``, a commit, a pull request's ``refs/pr/1``) follows the repository id, which alone must
    be ``owner/name``."""
    from lambdanet.models.hub import hub_repo

    assert hub_repo("hf-hub:someone/tiny@refs/pr/1") == "someone/tiny@refs/pr/1"
    assert hub_repo("hf-hub:someone/tiny@v1") == "someone/tiny@v1" and hub_repo("resnet26") is None
    for bad in ("hf-hub:someone@x/tiny", "hf-hub:someone", "hf-hub:/tiny", "hf-hub:a/b/c"):
        with pytest.raises(ValueError, match=r"^a hub model is named 'hf-hub:owner/name' \(or "
                                             r"'hf-hub:owner/name@revision'\), got "):
            hub_repo(bad)


def test_push_to_hub_uploads_the_repository_in_one_commit(monkeypatch, tmp_path):
    calls = []

    class RecordingApi:
        def __init__(self, token=None):
            calls.append(("init", token))

        def create_repo(self, repo_id, private=False, exist_ok=False):
            calls.append(("create_repo", repo_id, private, exist_ok))

        def upload_folder(self, repo_id, folder_path, revision=None, commit_message=None, delete_patterns=None):
            shutil.copytree(folder_path, tmp_path / "uploaded")
            calls.append(("upload_folder", repo_id, commit_message, delete_patterns))
            return "https://huggingface.co/someone/digits/commit/abc"

    monkeypatch.setattr(huggingface_hub, "HfApi", RecordingApi)
    url = lambdanet.push_to_hub(RUN, "someone/digits", private=True, token="t")
    assert url.endswith("/commit/abc")
    assert [c[0] for c in calls] == ["init", "create_repo", "upload_folder"] and calls[1][2:] == (True, True)
    # the remote files lambdanet writes are replaced as a whole: one an earlier upload had and this one lacks goes
    assert sorted(calls[2][3]) == sorted(["model.safetensors", "config.json", "README.md", "summary.json",
                                          "config.yaml"])  # fmt: skip
    card = (tmp_path / "uploaded" / "README.md").read_text()
    assert 'create_model("hf-hub:someone/digits")' in card and "OWNER/NAME" not in card
    with pytest.raises(ValueError, match="repo_id"):
        push_to_hub(RUN, "no-owner")


def test_hub_names_and_missing_repositories_are_one_line_errors(hub_cache):
    for name, needle in (("hf-hub:nobody", "owner/name"), ("hf-hub:someone/missing", "could not be had")):
        with pytest.raises(ValueError, match=needle) as info:
            create_model(name)
        assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="brings its own weights"):
        create_model("hf-hub:someone/missing", pretrained=True)


def test_hubconf_serves_every_registered_model_to_torch_hub(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))  # torch.hub prepends the repository
    spec = importlib.util.spec_from_file_location("hubconf", REPO / "hubconf.py")
    hubconf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hubconf)
    entries = {n for n in dir(hubconf) if callable(getattr(hubconf, n)) and not n.startswith("_")}
    assert entries == set(lambdanet.list_models())  # what torch.hub.list would show
    model = torch.hub.load(str(REPO), "lambda_resnet26", source="local", num_classes=4, in_chans=1)
    reference = create_model("lambda_resnet26", num_classes=4, in_chans=1)
    assert type(model) is type(reference) and model.pretrained_cfg == reference.pretrained_cfg
    assert [p.shape for p in model.parameters()] == [p.shape for p in reference.parameters()]


def test_the_push_to_hub_command_writes_or_uploads_the_repository(tmp_path, monkeypatch, capsys):
    from lambdanet.cli import main

    assert main(["push-to-hub", str(RUN), "someone/digits", "--folder", str(tmp_path / "repo")]) == 0
    assert (tmp_path / "repo" / "model.safetensors").read_bytes() == (RUN / "model_ema.safetensors").read_bytes()
    uploads = []
    monkeypatch.setattr("lambdanet.hub.push_to_hub", lambda run, repo, private: uploads.append((run, repo, private))
                        or "https://huggingface.co/someone/digits/commit/1")
    assert main(["push-to-hub", str(RUN), "someone/digits", "--private"]) == 0
    assert uploads == [(str(RUN), "someone/digits", True)] and "hf-hub:someone/digits" in capsys.readouterr().out
    assert main(["push-to-hub", str(tmp_path), "someone/digits", "--folder", str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err.count("\n") == 1


@pytest.mark.parametrize("fixture, name, options", [
    ("lm_runs_v02", "plain_lambda_lm_nano", {}),  # 0.1.x: options without short_conv, the plain model
    ("lm_runs_conv", "lambda_lm_nano", {"decay": None}),  # the convolution alone: short_conv without decay
    ("lm_runs_fixed", "lambda_lm_nano", {"decay": "fixed"}),  # today's default (short_conv and decay named)
])
def test_a_language_model_shared_before_a_default_moved_loads_as_the_model_it_trained(
    tmp_path, hub_cache, fixture, name, options
):
    """Weights of a ``lambda_lm_nano`` run written before ``lambda_lm_<size>``'s default moved (before the short
    convolution, or before the decay; or today's default, which must keep loading once it moves), put on the hub
    as they are with their run metadata, build back as the model they trained, with its own logits, and say so in
    ``model_kwargs`` (saved again, they stay that model)."""
    from lambdanet.tasks.lm import load_lm

    run = REPO / "tests" / "fixtures" / fixture / "lm_done"
    (tmp_path / "repo").mkdir()
    shutil.copyfile(run / "model.safetensors", tmp_path / "repo" / "model.safetensors")
    hub_cache(tmp_path / "repo", f"someone/{fixture}")
    shared = create_model(f"hf-hub:someone/{fixture}").eval()
    own = load_lm(run)
    assert shared.model_name == own.model_name == name
    assert all(k in shared.model_kwargs and shared.model_kwargs[k] == v for k, v in options.items())
    mixer = shared.blocks[0].mixer
    assert (mixer.decay, mixer.heads) == (options.get("decay"), 2)  # nano's own two heads
    tokens = torch.randint(0, 256, (2, 24))
    with torch.no_grad():
        assert torch.equal(shared(tokens), own(tokens))
