"""The language-model families (causal lambda LM, transformer and linear-attention baselines): parameter
parity, causality, streaming generation equal to the parallel forward, and the `lambdanet lm` commands.

Tolerance of the streaming checks: float64 models whose step-by-step and parallel forms sum the same terms in
another order; over two blocks of ``~d`` features the relative difference stays ``~1e-15`` (measured 1e-15),
the issue's bound is ``1e-10``."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import shutil

import numpy as np
import pytest
import torch

import lambdanet
from lambdanet import create_model, list_models
from lambdanet.models import model_args
from lambdanet.cli import main
from lambdanet.tasks.lm.data import VAL_PERCENT, is_validation_file, load_corpus
from lambdanet.tasks.lm.task import LMConfig, evaluate_bits_per_byte, load_lm, sample, train_lm
from lambdanet.engine.checkpoint import load_checkpoint
from lambdanet.models.lm import LM_SIZES, matched_dim_v, sample_next

FAMILIES = ("lambda_lm", "plain_lambda_lm", "transformer_lm", "linear_lm", "hybrid_lm")


def rel(a, b):
    return float((a - b).detach().norm() / b.detach().norm())


def perturbed(name, **kwargs):
    """A float64 model whose weights are far from their initialisation (all terms matter)."""
    torch.manual_seed(0)
    model = create_model(name, **kwargs).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model


def test_the_families_are_registered_one_entry_per_size():
    assert list_models("*_lm_*") == sorted(f"{f}_{s}" for f in FAMILIES for s in LM_SIZES)


@pytest.mark.parametrize("size", list(LM_SIZES))
def test_same_size_families_have_parameter_counts_within_2_percent(size):
    counts = {f: sum(p.numel() for p in create_model(f"{f}_{size}").parameters()) for f in FAMILIES}
    for family, count in counts.items():
        assert abs(count / counts["transformer_lm"] - 1) < 0.02, (family, counts)


@pytest.mark.parametrize("size", ["tiny", "nano"])
@pytest.mark.parametrize("kwargs", [{"dim_k": 32}, {"heads": 2}, {"heads": 8, "dim_k": 8}, {"r": 128}])
def test_the_registered_lambda_models_take_the_layer_shape_and_keep_the_budget(kwargs, size):
    """``heads``, ``dim_k``, ``r`` and ``mlp_ratio`` are architecture options of the registered models (the
    ablations vary them), with the size's values by default; the value depth follows ``heads`` and ``dim_k``
    (matched_dim_v), so the parameter count stays within 2% of the transformer's of the same size at ``tiny``. At
    ``nano`` (d = 64) a step of 8 in the value depth is 8-14% of the budget, so its own depth is matched by hand
    (64, beside the convolution); another shape takes the plain model's matched depth (nano's stayed at 64
    whatever the shape: +53% at 8 heads), the convolution and decay rates adding their own parameters."""
    model = create_model(f"lambda_lm_{size}", **kwargs)
    layer, s = model.blocks[0].mixer, LM_SIZES[size]
    expected = {"heads": s.heads, "dim_k": s.dim_k, "r": s.r, **kwargs}
    assert (layer.heads, layer.dim_k, layer.r) == (expected["heads"], expected["dim_k"], expected["r"])
    own_shape = (expected["heads"], expected["dim_k"]) == (s.heads, s.dim_k)
    assert layer.dim_v == (64 if size == "nano" and own_shape else matched_dim_v(s.dim, expected["heads"],
                                                                                 expected["dim_k"]))  # fmt: skip
    params = sum(p.numel() for p in model.parameters())
    if size == "tiny":
        transformer = sum(p.numel() for p in create_model("transformer_lm_tiny").parameters())
        assert abs(params / transformer - 1) < 0.02 + (kwargs.get("r", s.r) - s.r) * s.dim_k * s.depth / transformer
    elif not own_shape:
        plain = sum(p.numel() for p in create_model("plain_lambda_lm_nano", **kwargs).parameters())
        added = sum(p.numel() for n, p in model.named_parameters() if ".conv." in n or "decay_rate" in n)
        assert added and params == plain + added
    tiny = LM_SIZES["tiny"]
    assert model_args("lambda_lm_tiny")["dim_k"] == tiny.dim_k and model_args("lambda_lm_nano")["r"] == 16
    wider = create_model("transformer_lm_tiny", mlp_ratio=2.0)
    assert wider.blocks[0].mlp[0].out_features == 2 * tiny.dim


def test_the_default_lambda_model_is_the_plain_one_with_a_short_convolution_and_a_fixed_decay():
    """``lambda_lm_<size>`` = ``plain_lambda_lm_<size>`` (the paper's layer alone) + ``short_conv=4`` +
    ``decay="fixed"`` (issue 37's study, ``fixed_conv4``; at nano also ``dim_v=64``, which keeps the budget): the
    same modules and outputs from the same seed; ``short_conv=0, decay=None`` gives the plain model's modules
    back, ``decay=None`` the convolution alone (the default before, ``short_conv4``)."""
    x = torch.randint(0, 256, (2, 40))
    torch.manual_seed(0)
    default = create_model("lambda_lm_nano").eval()
    torch.manual_seed(0)
    plain4 = create_model("plain_lambda_lm_nano", short_conv=4, decay="fixed", dim_v=64).eval()
    mixer = default.blocks[0].mixer
    assert (mixer.short_conv, mixer.decay) == (4, "fixed") and mixer.decay_rate is not None
    assert model_args("lambda_lm_nano")["short_conv"] == 4 and model_args("lambda_lm_nano")["decay"] == "fixed"
    assert model_args("plain_lambda_lm_nano")["short_conv"] == 0 and model_args("plain_lambda_lm_nano")["decay"] is None
    with torch.no_grad():
        assert torch.equal(default(x), plain4(x))
    plain_keys = create_model("plain_lambda_lm_tiny").state_dict().keys()
    assert create_model("lambda_lm_tiny", short_conv=0, decay=None).state_dict().keys() == plain_keys
    conv_keys = create_model("plain_lambda_lm_tiny", short_conv=4).state_dict().keys()
    assert create_model("lambda_lm_tiny", decay=None).state_dict().keys() == conv_keys
    assert create_model("lambda_lm_tiny").state_dict().keys() - conv_keys == {
        f"blocks.{i}.mixer.decay_rate" for i in range(LM_SIZES["tiny"].depth)}
    tiny = create_model("lambda_lm_tiny").blocks[0].mixer
    assert (tiny.short_conv, tiny.dim_v) == (4, create_model("plain_lambda_lm_tiny").blocks[0].mixer.dim_v)


@pytest.mark.parametrize("kw", [{"content": False}, {"key_norm": "l2"}, {"key_norm": "none"}])
def test_options_that_turn_off_the_prefix_softmax_build_the_default_without_its_decay(kw, tmp_path, corpus_dir):
    """The default decay needs the content lambdas' prefix softmax: a ``lambda_lm_<size>`` asked for options
    without it goes without the decay (its convolution kept), and its run records ``decay=None``, which reads
    back as itself; a decay the user names with them is still a one-line error."""
    from lambdanet.models.lm_zoo import pin_lm_kwargs, saved_lm

    mixer = create_model("lambda_lm_nano", **kw).blocks[0].mixer
    assert (mixer.decay, mixer.decay_rate, mixer.short_conv) == (None, None, 4)
    pinned = pin_lm_kwargs("lambda_lm_nano", kw)
    assert pinned == {"short_conv": 4, "decay": None, "dim_v": 64, **kw}
    assert lm_config(tmp_path, corpus_dir, model_kwargs=kw).model_kwargs == pinned
    assert saved_lm("lambda_lm_nano", pinned) == ("lambda_lm_nano", pinned)
    with pytest.raises(ValueError, match="decay='fixed' needs the content lambdas' prefix softmax"):
        create_model("lambda_lm_nano", decay="fixed", **kw)


def test_runs_write_the_moved_defaults_out_and_read_older_runs_as_the_model_they_trained(tmp_path, corpus_dir):
    """A new run records ``short_conv`` and ``decay`` of a ``lambda_lm_<size>`` (its own values kept); a saved
    run whose options lack ``short_conv`` was written before the first move and names the plain model, one that
    names ``short_conv`` but not ``decay`` before the second, and gets ``decay=None``; other families are
    untouched; what :func:`pin_lm_kwargs` writes reads back as itself."""
    from lambdanet.models.lm_zoo import pin_lm_kwargs, saved_lm

    assert lm_config(tmp_path, corpus_dir).model_kwargs == {"short_conv": 4, "decay": "fixed", "dim_v": 64}
    given = lm_config(tmp_path, corpus_dir, model_kwargs={"short_conv": 0, "r": 8})
    assert (given.model, given.model_kwargs) == ("lambda_lm_nano", {"short_conv": 0, "decay": "fixed", "dim_v": 64,
                                                                     "r": 8})  # fmt: skip
    assert pin_lm_kwargs("lambda_lm_tiny", {}) == {"short_conv": 4, "decay": "fixed"}
    assert pin_lm_kwargs("lambda_lm_tiny", {"decay": None}) == {"short_conv": 4, "decay": None}
    assert lm_config(tmp_path, corpus_dir, model="plain_lambda_lm_nano").model_kwargs == {}
    assert saved_lm("lambda_lm_tiny", {"r": 8}) == ("plain_lambda_lm_tiny", {"r": 8})
    assert saved_lm("lambda_lm_tiny", {"decay": "gate"}) == ("plain_lambda_lm_tiny", {"decay": "gate"})
    assert saved_lm("lambda_lm_tiny", {"short_conv": 4}) == ("lambda_lm_tiny", {"short_conv": 4, "decay": None})
    for pinned in ({"short_conv": 4, "decay": "fixed"}, {"short_conv": 2, "decay": None, "r": 8}):
        assert saved_lm("lambda_lm_tiny", pinned) == ("lambda_lm_tiny", pinned)
    for size in LM_SIZES:
        model = f"lambda_lm_{size}"
        assert saved_lm(model, pin_lm_kwargs(model, {})) == (model, pin_lm_kwargs(model, {}))
    for name in ("hybrid_lm_tiny", "linear_lm_tiny", "plain_lambda_lm_tiny", "transformer_lm_nano"):
        assert saved_lm(name, {}) == (name, {}) and pin_lm_kwargs(name, {}) == {}


def test_matched_value_depth_gives_attention_parameters():
    # d (h k + k + v + h v) against 4 d^2, for the sizes' shapes: within one multiple of 8 of the optimum
    for s in LM_SIZES.values():
        v = matched_dim_v(s.dim, s.heads, s.dim_k)
        params = s.dim * (s.heads * s.dim_k + s.dim_k + v + s.heads * v)
        assert abs(params - 4 * s.dim**2) <= 8 * s.dim * (s.heads + 1) / 2 + 1


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_shape_any_vocabulary_and_causality(family):
    model = perturbed(f"{family}_nano", vocab_size=1000)
    tokens = torch.randint(0, 1000, (2, 50), generator=torch.Generator().manual_seed(0))
    logits = model(tokens)
    assert logits.shape == (2, 50, 1000)
    changed = tokens.clone()
    changed[:, 30:] = (changed[:, 30:] + 1) % 1000
    other = model(changed)
    # no position sees a later one; the chunked form's shared chunk maximum only reorders rounding (a few eps)
    assert rel(other[:, :30], logits[:, :30]) < 1e-12
    assert rel(other[:, 30:], logits[:, 30:]) > 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_streaming_steps_equal_the_parallel_forward(family):
    model = perturbed(f"{family}_nano")
    tokens = torch.randint(0, 256, (2, 70), generator=torch.Generator().manual_seed(1))  # > chunk and r
    full = model(tokens)
    state, steps = model.init_state(2), []
    for t in range(70):
        logits, state = model.step(state, tokens[:, t])
        steps.append(logits)
    assert rel(torch.stack(steps, dim=1), full) < 1e-10
    _, state = model(tokens[:, :33], return_state=True)  # a parallel prefix, then steps
    rest = []
    for t in range(33, 70):
        logits, state = model.step(state, tokens[:, t])
        rest.append(logits)
    assert rel(torch.stack(rest, dim=1), full[:, 33:]) < 1e-10


@pytest.mark.parametrize("family", FAMILIES)
def test_a_training_forward_asks_no_mixer_for_its_state(family, monkeypatch):
    """``model(tokens)`` (a training step) calls every mixer without ``return_state`` (the lambda layers then make
    no final state: no window, no float32 copies, no convolution state), with the logits of a stateful call bit
    for bit; ``return_state=True`` still asks each mixer for its state."""
    model = perturbed(f"{family}_nano")
    asked: list[bool] = []

    def spy(forward):
        def call(x, state=None, return_state=False):
            asked.append(return_state)
            return forward(x, state, return_state=return_state)

        return call

    for block in model.blocks:
        monkeypatch.setattr(block.mixer, "forward", spy(block.mixer.forward))
    tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(3))
    plain = model(tokens)
    assert asked == [False] * len(model.blocks)
    asked.clear()
    logits, state = model(tokens, return_state=True)
    assert asked == [True] * len(model.blocks) and len(state["layers"]) == len(model.blocks)
    assert torch.equal(plain, logits)


def state_bytes(state) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    items = state.values() if isinstance(state, dict) else state
    return sum(state_bytes(s) for s in items)


def test_lambda_state_size_does_not_grow_the_kv_cache_does():
    sizes = {}
    for family in ("lambda_lm", "transformer_lm"):
        model = create_model(f"{family}_nano").eval()
        with torch.no_grad():
            sizes[family] = [state_bytes(model(torch.zeros(1, n, dtype=torch.long), return_state=True)[1])
                             for n in (100, 1000)]
    assert sizes["lambda_lm"][0] == sizes["lambda_lm"][1] == state_bytes(create_model("lambda_lm_nano").init_state(1))
    assert sizes["transformer_lm"][1] > 9 * sizes["transformer_lm"][0]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_is_the_argmax_of_the_parallel_forward(family):
    model = perturbed(f"{family}_nano")
    prompt = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(2))
    out = model.generate(prompt, 12, top_k=1)
    expected = prompt
    for _ in range(12):  # independent: the whole sequence re-run in parallel for every new token
        expected = torch.cat([expected, model(expected)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, expected)


def test_sampling_is_seeded_and_top_k_restricts_it():
    model = perturbed("lambda_lm_nano")
    prompt = torch.tensor([[1, 2, 3]])
    a = model.generate(prompt, 20, temperature=1.5, generator=torch.Generator().manual_seed(5))
    b = model.generate(prompt, 20, temperature=1.5, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a, b) and a.shape == (1, 23)
    top3 = model.generate(prompt, 1, top_k=3, generator=torch.Generator().manual_seed(0))[0, -1]
    assert top3 in model(prompt)[0, -1].topk(3).indices
    with pytest.raises(ValueError, match="temperature must be > 0"):
        model.generate(prompt, 2, temperature=0.0)
    with pytest.raises(ValueError, match="temperature must be > 0"):  # checked before the prompt's forward
        model.generate(prompt, 0, temperature=-1.0)
    # a 0-d tensor as max_new_tokens and top_k take one (it was "got tensor(1.5000)")
    c = model.generate(prompt, 20, temperature=torch.tensor(1.5), generator=torch.Generator().manual_seed(5))
    assert torch.equal(c, a)
    with pytest.raises(ValueError, match=r"temperature must be > 0 and finite, got 0.0$"):
        model.generate(prompt, 2, temperature=torch.tensor(0.0))
    with pytest.raises(ValueError, match=r"temperature must be > 0 and finite, got tensor\(\.\.\., device='meta'"):
        model.generate(prompt, 2, temperature=torch.tensor(0.5, device="meta"))  # no value to read: refused


def test_sampling_at_extreme_temperatures_tends_to_argmax_and_to_uniform():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    for t in (1e-30, 1e-40, 1e-300):  # below float32's range: the arg-max, not inf / NaN probabilities
        assert torch.equal(sample_next(logits, t), logits.argmax(-1))
    rows = logits[:1].expand(4000, -1)
    top = set(logits[0].topk(5).indices.tolist())
    for t in (1e39, 1e300):  # above float32's range: uniform over the top 5
        draws = sample_next(rows, t, top_k=5, generator=torch.Generator().manual_seed(1))
        counts = torch.bincount(draws, minlength=50)
        assert set(draws.unique().tolist()) == top
        # 4000 draws of p = 1/5: mean 800, sd sqrt(4000 x 0.2 x 0.8) = 25; 6 sd
        assert (counts[sorted(top)] - 800).abs().max() < 150
    limited = sample_next(rows, 1e3, generator=torch.Generator().manual_seed(2), token_limit=7)
    assert int(limited.max()) < 7 and len(limited.unique()) == 7
    assert sample_next(logits, np.float32(1e-30)).tolist() == logits.argmax(-1).tolist()  # numpy numbers too
    for bad in (float("inf"), float("nan"), True, "1"):
        with pytest.raises(ValueError, match="temperature must be > 0 and finite"):
            sample_next(logits, bad)
    wide = sample_next(rows, 1e3, generator=torch.Generator().manual_seed(2), token_limit=256)  # >= vocab: no limit
    assert len(wide.unique()) == 50
    with pytest.raises(ValueError, match="token_limit must be a positive int, got 0"):
        sample_next(logits, 1.0, token_limit=0)


def test_byte_tensors_are_tokens_and_wrong_types_are_named():
    model = perturbed("lambda_lm_nano").float()
    prompt = torch.tensor([[104, 105, 33]])
    assert torch.equal(model(prompt.to(torch.uint8)), model(prompt))
    out = model.generate(prompt.to(torch.uint8), np.int64(4), top_k=1)
    assert torch.equal(out, model.generate(prompt, 4, top_k=1)) and out.dtype == torch.long
    logits, _ = model.step(model.init_state(1), torch.tensor([104], dtype=torch.uint8))
    assert torch.allclose(logits, model(prompt[:, :1])[:, 0], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"got a float32 tensor of shape \(1, 3\)"):
        model(prompt.float())
    with pytest.raises(ValueError, match=r"tokens must be an integer tensor \[batch\] or \[batch, 1\], got int"):
        model.step(model.init_state(1), 3)


def test_bad_tokens_and_too_long_prompts_are_one_line_errors():
    model = create_model("transformer_lm_nano", positions="learned", max_len=16)
    with pytest.raises(ValueError, match=r"tokens must lie in \[0, vocab_size=256\)"):
        model(torch.tensor([[0, 300]]))
    with pytest.raises(ValueError, match="the sequence is 17 tokens long but the model takes at most max_len=16"):
        model.generate(torch.zeros(1, 10, dtype=torch.long), 8)  # it reads the prompt and 7 of the 8 new tokens
    # 10 + 7: the model reads 16 positions (never the last token sampled), all it takes; greedy, the state's
    # continuation is the arg-max of the whole sequence read at once (it was refused as 17 tokens long)
    out = model.eval().generate(torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(0)), 7,
                                top_k=1)  # fmt: skip
    with torch.no_grad():
        assert out.shape == (1, 17) and torch.equal(model(out[:, :16]).argmax(-1)[:, 9:], out[:, 10:])
    with pytest.raises(ValueError, match="integer tensor"):
        model(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="needs max_len"):
        create_model("transformer_lm_nano", positions="learned")


def test_stdlib_split_is_by_path_hash_and_disjoint():
    corpus = load_corpus("stdlib")
    train_files, val_files = corpus.files
    assert train_files and val_files
    assert abs(val_files / (train_files + val_files) - VAL_PERCENT / 100) < 0.02  # ~5% of ~1,800 files
    assert is_validation_file("os.py") == is_validation_file("os.py")
    assert corpus.val.numel() > 100_000 and corpus.train.numel() > 20 * corpus.val.numel() / 2


def test_text_corpora_bytes_and_errors(tmp_path):
    (tmp_path / "a.bin").write_bytes(bytes(range(256)) * 4)  # not UTF-8: fine, bytes are tokens
    corpus = load_corpus(f"text:{tmp_path / 'a.bin'}")
    assert corpus.train.numel() + corpus.val.numel() == 1024 and corpus.max_byte == 255
    assert corpus.val.numel() == 1024 * VAL_PERCENT // 100
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no bytes"):
        load_corpus(f"text:{tmp_path / 'empty'}")
    with pytest.raises(ValueError, match="does not exist"):
        load_corpus(f"text:{tmp_path / 'missing'}")
    with pytest.raises(ValueError, match="'stdlib' or 'text:FILE|DIR'"):
        load_corpus("wikipedia")


def test_a_folder_corpus_leaves_out_runs_written_into_it_and_takes_any_file_name(tmp_path):
    """``lm train --data text:. --out runs/x`` read its own run on ``--resume`` (checkpoint, weights, plots): 0.04
    MB of text became 1.87 MB, validated on the tail of the binaries. A folder holding a run (config.yaml beside
    last.pt or model.safetensors) is not corpus; a folder with only a config.yaml is. A file whose name is not
    UTF-8 failed the split ("surrogates not allowed"): its name's bytes are hashed, the same bytes as before for
    every UTF-8 name."""
    import hashlib
    import os

    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_bytes(b"q" * 400)
    before = load_corpus(f"text:{tmp_path}")
    run = tmp_path / "runs" / "x"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("model: lambda_lm_nano\n")
    (tmp_path / "runs" / "notes").mkdir()
    (tmp_path / "runs" / "notes" / "config.yaml").write_bytes(b"c" * 100)  # a corpus's own config.yaml: kept
    (run / "last.pt").write_bytes(b"\x80" * 5000)
    (run / "metrics.csv").write_bytes(b"m" * 500)
    after = load_corpus(f"text:{tmp_path}")
    total = lambda c: c.train.numel() + c.val.numel()  # noqa: E731
    assert total(after) == total(before) + 100 and sum(after.files) == sum(before.files) + 1
    odd = os.fsdecode(b"caf\xe9.txt")  # a Latin-1 name, as Linux gives it to Python
    (tmp_path / odd).write_bytes(b"w" * 300)
    assert total(load_corpus(f"text:{tmp_path}")) == total(after) + 300
    expected = int(hashlib.sha256(b"caf\xe9.txt").hexdigest(), 16) % 100 < VAL_PERCENT
    assert is_validation_file(odd) == expected
    assert is_validation_file("os.py") == (int(hashlib.sha256(b"os.py").hexdigest(), 16) % 100 < VAL_PERCENT)


def test_a_learning_rate_below_the_default_floor_gets_a_floor_of_its_own(tmp_path):
    """``lm train --lr 1e-4`` failed "min_lr must be in [0, 0.0001] ... got 0.0003": a floor the user never set.
    It is lr / 10, the defaults' own ratio (3e-3 / 3e-4); a min_lr given is checked as before."""
    from lambdanet.tasks.lm.config import LMConfig

    out = str(tmp_path / "o")
    assert LMConfig.resolve(overrides={"lr": 1e-4, "out": out}).min_lr == pytest.approx(1e-5)
    assert LMConfig.resolve(overrides={"out": out}).min_lr == 3e-4 == LMConfig.resolve(overrides={"lr": 1e-2,
                                                                                                   "out": out}).min_lr
    with pytest.raises(ValueError, match=r"min_lr must be in \[0, 0.0001\]"):
        LMConfig.resolve(overrides={"lr": 1e-4, "min_lr": 3e-4, "out": out})


def test_tiny_corpora_keep_bytes_to_validate_on(tmp_path):
    (tmp_path / "b30.txt").write_bytes(b"x" * 30)  # 5% of 30 is 1 byte: a split of one byte predicts nothing
    corpus = load_corpus(f"text:{tmp_path / 'b30.txt'}")
    assert corpus.val.numel() == 2 and corpus.train.numel() == 28
    (tmp_path / "b3.txt").write_bytes(b"abc")
    with pytest.raises(ValueError, match="holds 3 byte"):
        load_corpus(f"text:{tmp_path / 'b3.txt'}")
    folder = tmp_path / "files"  # a hash split whose validation file holds one byte: the tail split instead
    folder.mkdir()
    names = [f"f{i}.txt" for i in range(200)]
    one = next(n for n in names if is_validation_file(n))
    names = [one] + [n for n in names if not is_validation_file(n)][:20]
    for n in names:
        (folder / n).write_bytes(b"z" if n == one else b"y" * 40)
    split = load_corpus(f"text:{folder}")
    assert split.files[1] == 0 and split.val.numel() >= 2


def test_bits_per_byte_of_nothing_is_nan_not_zero():
    class Uniform(torch.nn.Module):
        def forward(self, tokens):
            return torch.zeros(*tokens.shape, 256)

    res = evaluate_bits_per_byte(Uniform(), torch.tensor([7]), 8)
    assert res["bytes"] == 0 and math.isnan(res["bits_per_byte"])
    with pytest.raises(ValueError, match="context must be a positive int, got 0"):
        evaluate_bits_per_byte(Uniform(), torch.arange(10), 0)
    with pytest.raises(ValueError, match="batch_size must be a positive int, got 0"):
        evaluate_bits_per_byte(Uniform(), torch.arange(10), 4, batch_size=0)


def test_bits_per_byte_of_a_uniform_model_is_8():
    class Uniform(torch.nn.Module):
        def forward(self, tokens):
            return torch.zeros(*tokens.shape, 256)

    res = evaluate_bits_per_byte(Uniform(), torch.arange(1000) % 256, 64, batch_size=3)
    assert res["bytes"] == 999 and res["bits_per_byte"] == pytest.approx(8.0, abs=1e-6)


@pytest.fixture()
def corpus_dir(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(4):  # a repetitive text a small model learns within a few dozen steps
        (folder / f"f{i}.txt").write_text("def add(a, b):\n    return a + b\n" * (40 + i))
    return folder


def lm_config(tmp_path, corpus_dir, **kw):
    values = {"data": f"text:{corpus_dir}", "model": "lambda_lm_nano", "context": 32, "epochs": 2,
              "steps_per_epoch": 15, "batch_size": 8, "warmup_steps": 5, "out": str(tmp_path / "run"),
              "tensorboard": False, "progress": False, "eval_bytes": None} | kw
    return LMConfig.resolve(overrides=values)


def test_training_learns_and_sampling_continues_the_prompt(tmp_path, corpus_dir, capsys):
    summary = train_lm(lm_config(tmp_path, corpus_dir), log=lambda _: None)
    saved = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert saved["val_bits_per_byte"] == pytest.approx(summary["val_bits_per_byte"])
    assert summary["val_bits_per_byte"] < 4.0  # from log2(256) = 8 bits for an untrained model
    rows = list(csv.DictReader((tmp_path / "run" / "metrics.csv").open()))  # the best epoch: the fewest bits
    assert summary["best_epoch_val_bits_per_byte"] == min(float(r["val_bits_per_byte"]) for r in rows)
    model = load_lm(tmp_path / "run")
    again = evaluate_bits_per_byte(model, load_corpus(f"text:{corpus_dir}").val, 32)
    assert again["bits_per_byte"] == pytest.approx(summary["val_bits_per_byte"], rel=1e-5)
    text = sample(tmp_path / "run", "def add", max_new_tokens=20, top_k=1)
    assert text.startswith(b"def add") and len(text) == 27
    assert main(["lm", "sample", "--checkpoint", str(tmp_path / "run"), "--prompt", "def", "--max-new-tokens", "5",
                 "--top-k", "1"]) == 0
    assert capsys.readouterr().out.startswith("def")
    assert main(["lm", "sample", "--checkpoint", str(tmp_path / "run"), "--prompt", "def", "--cuda-graph"]) == 2
    err = capsys.readouterr().err.strip()
    assert "cuda_graph=True needs the model and tokens on a CUDA device, got cpu" in err and "\n" not in err
    assert "error: --cuda-graph needs --device cuda:" in err  # the flag the user typed leads, then the API's words
    probe = torch.tensor([list(b"def add(a")])
    (tmp_path / "away").mkdir()  # a checkpoint copied away from its run directory (no config.yaml beside it)
    shutil.copy(tmp_path / "run" / "last.pt", tmp_path / "away" / "lm.pt")
    for where in (tmp_path / "run", tmp_path / "run" / "model.safetensors", tmp_path / "run" / "last.pt",
                  tmp_path / "away" / "lm.pt"):
        loaded = lambdanet.load_model(where)  # the package's loader takes language-model runs too
        assert not loaded.training and torch.equal(loaded(probe), model(probe))
    from lambdanet.tasks.classification.load import load_model as load_classifier

    with pytest.raises(ValueError, match="is a language-model run .lambdanet lm train., not an image-classification"):
        load_classifier(tmp_path / "run")


def test_a_configuration_built_directly_trains_as_the_resolved_one_and_loads_back(tmp_path, corpus_dir):
    """``train_lm(LMConfig(...))`` without :meth:`LMConfig.resolve` records what the resolved configuration records
    (the ``lambda_lm_<size>`` defaults pinned, the data path absolute), so the run loads as the model it trained;
    a copy of a resolved configuration is left as it is."""
    values = {"data": f"text:{corpus_dir}", "model": "lambda_lm_nano", "context": 32, "epochs": 1,
              "steps_per_epoch": 2, "batch_size": 2, "eval_bytes": 200, "out": str(tmp_path / "direct"),
              "tensorboard": False, "progress": False}  # fmt: skip
    summary = train_lm(LMConfig(**values), log=lambda _: None)
    recorded = load_checkpoint(tmp_path / "direct" / "last.pt")["config"]
    expected = dataclasses.asdict(LMConfig.resolve(overrides={**values, "out": str(tmp_path / "other")}))
    assert {**recorded, "out": None} == {**expected, "out": None}
    assert summary["model_kwargs"] == {"short_conv": 4, "decay": "fixed", "dim_v": 64}
    model = load_lm(tmp_path / "direct")
    assert model.lm_cfg["model"] == "lambda_lm_nano" and math.isfinite(summary["val_bits_per_byte"])
    from lambdanet.engine.task import resolved

    # a copy of a resolved configuration (dataclasses.replace) keeps its values, the recipe's included, even those
    # equal to the class's defaults
    long = LMConfig.resolve("long_small", overrides={"out": str(tmp_path / "long"), "context": LMConfig.context})
    assert LMConfig.RECIPES["long_small"]["context"] != LMConfig.context  # the recipe would change what was given
    copied = dataclasses.replace(long, out=str(tmp_path / "copy"))
    assert dataclasses.asdict(resolved(copied)) == {**dataclasses.asdict(long), "out": str(tmp_path / "copy")}
    # resume: the run's config.yaml, as --resume reads it
    again = resolved(LMConfig(out=str(tmp_path / "direct"), resume=True))
    assert again.model_kwargs == summary["model_kwargs"] and again.check_resume() == 1
    with pytest.raises(ValueError, match=r"^context must be a positive int, got 0$"):
        train_lm(LMConfig(**{**values, "context": 0}), log=lambda _: None)


def test_a_crashed_run_resumes_to_the_uninterrupted_weights(tmp_path, corpus_dir, power_cut):
    whole = lm_config(tmp_path, corpus_dir, out=str(tmp_path / "whole"))
    train_lm(whole, log=lambda _: None)
    cut = lm_config(tmp_path, corpus_dir, out=str(tmp_path / "cut"))
    with power_cut(20), pytest.raises(RuntimeError):
        train_lm(cut, log=lambda _: None)
    train_lm(LMConfig.resolve(overrides={"out": str(tmp_path / "cut"), "resume": True}), log=lambda _: None)
    a, b = load_lm(tmp_path / "whole").state_dict(), load_lm(tmp_path / "cut").state_dict()
    for key in a:  # the same operations in the same order on one process: bit for bit
        assert torch.equal(a[key], b[key]), key


def test_an_extended_run_cut_short_loads_as_its_checkpoint_not_its_old_end(tmp_path, corpus_dir, power_cut):
    """A finished run extended by --resume --epochs: its old model.safetensors is no longer its end, so a crash
    during the extension leaves a run directory that loads as last.pt (the newest weights), not the old end."""
    out = tmp_path / "run"
    train_lm(lm_config(tmp_path, corpus_dir, epochs=1), log=lambda _: None)
    old = load_lm(out / "model.safetensors").state_dict()
    with power_cut(20), pytest.raises(RuntimeError):  # epoch 3's 5th step (15 an epoch), after epoch 2's checkpoint
        train_lm(LMConfig.resolve(overrides={"out": str(out), "resume": True, "epochs": 3}), log=lambda _: None)
    assert not (out / "model.safetensors").exists() and not (out / "summary.json").exists()  # (the old end's)
    now, saved = load_lm(out).state_dict(), load_checkpoint(out / "last.pt")
    assert saved["epoch"] == 2 and all(torch.equal(now[k], saved["model"][k]) for k in now)
    assert any(not torch.equal(now[k], old[k]) for k in now)
    train_lm(LMConfig.resolve(overrides={"out": str(out), "resume": True, "epochs": 3}), log=lambda _: None)
    assert (out / "model.safetensors").is_file() and json.loads((out / "summary.json").read_text())["epochs"] == 3


def test_a_model_with_more_tokens_than_bytes_samples_bytes(tmp_path, corpus_dir):
    """--vocab-size above 256 is allowed; sampling keeps to the 256 byte tokens (a token >= 256 has no byte)."""
    train_lm(lm_config(tmp_path, corpus_dir, vocab_size=300, epochs=1, steps_per_epoch=2), log=lambda _: None)
    text = sample(tmp_path / "run", "def", max_new_tokens=300, temperature=1e6)  # near uniform over the tokens
    assert len(text) == 303  # bytes() of a token >= 256 used to fail here, for 44 of every 300 draws


def test_command_line_errors_are_one_line(tmp_path, corpus_dir, capsys):
    (tmp_path / "high.bin").write_bytes(bytes([200]) * 500)
    assert main(["lm", "train", "--data", f"text:{tmp_path / 'high.bin'}", "--vocab-size", "128", "--out",
                 str(tmp_path / "v"), "--model", "lambda_lm_nano"]) == 2
    err = capsys.readouterr().err
    assert "byte values up to 200 but vocab_size is 128" in err and err.count("\n") == 1
    assert main(["lm", "train", "--model", "lambda_resnet26", "--out", str(tmp_path / "m")]) == 2
    assert "must be a language model" in capsys.readouterr().err


def test_a_last_step_that_diverges_is_an_error_not_a_result(tmp_path, corpus_dir, capsys):
    """One step at lr 1e30: its loss was finite (before the update), the weights after it overflow every forward
    pass. The loss guard would see it at a next step; the run had none, so it ended with exit 0, a NaN validation
    figure and the diverged weights saved. Now it is the one-line divergence error, nothing saved."""
    out = tmp_path / "run"
    assert main(["lm", "train", "--data", f"text:{corpus_dir}", "--model", "lambda_lm_nano", "--context", "32",
                 "--epochs", "1", "--steps-per-epoch", "1", "--warmup-steps", "0", "--lr", "1e30", "--batch-size",
                 "8", "--out", str(out), "--no-progress", "--no-tensorboard"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "the validation loss became nan in the evaluation of epoch 1" in err and "Lower --lr" in err
    assert err.count("\n") == 1 and not (out / "last.pt").exists()


def test_bf16_autocast_forward_is_float32s_to_bf16_rounding_and_a_bf16_run_learns(tmp_path, corpus_dir):
    """Under CPU bf16 autocast the linear layers run in bf16 (unit roundoff 2^-8 = 3.9e-3) and the causal lambda
    in float32: the logits stay within 3e-2 relative RMS of float32's (a few roundings in sequence through two
    blocks), far from an unnormalised or overflowing sum (relative error ~1). A bf16 run trains as float32's."""
    torch.manual_seed(0)
    model = create_model("lambda_lm_nano").eval()
    tokens = torch.randint(0, 256, (2, 100))
    with torch.no_grad():
        ref = model(tokens)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = model(tokens).float()
    assert ((low - ref).norm() / ref.norm()).item() < 3e-2
    summary = train_lm(lm_config(tmp_path, corpus_dir, amp="bf16"), log=lambda _: None)
    assert summary["val_bits_per_byte"] < 4.0  # from log2(256) = 8 bits, as the float32 run above


def test_torchrun_two_processes_train_as_one_with_the_same_global_batch(tmp_path, corpus_dir):
    """``lambdanet lm train`` under torchrun: each rank takes half of every global batch of windows; the same
    global batch on one process gives the same weight updates (float32 reduction-order noise, ~1e-6, against an
    update of ~1e-2: a wrong shard or a missing average differs by O(1))."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    args = ["lm", "train", "--data", f"text:{corpus_dir}", "--model", "lambda_lm_nano", "--context", "32",
            "--epochs", "1", "--steps-per-epoch", "6", "--batch-size", "8", "--warmup-steps", "2", "--no-progress",
            "--no-tensorboard", "--eval-bytes", "256"]
    env = {**__import__("os").environ, "PYTHONWARNINGS": "ignore"}
    ddp = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          "-m", "lambdanet", *args, "--out", str(tmp_path / "ddp")], capture_output=True, text=True,
                         timeout=300, env=env)
    assert ddp.returncode == 0, ddp.stderr[-2000:]
    assert main([*args, "--out", str(tmp_path / "one")]) == 0
    s_ddp = json.loads((tmp_path / "ddp" / "summary.json").read_text())
    s_one = json.loads((tmp_path / "one" / "summary.json").read_text())
    assert (s_ddp["processes"], s_one["processes"]) == (2, 1)
    torch.manual_seed(0)
    init = create_model("lambda_lm_nano").state_dict()
    a, b = load_file(tmp_path / "ddp" / "model.safetensors"), load_file(tmp_path / "one" / "model.safetensors")
    da = torch.cat([(a[k] - init[k]).flatten() for k in init])
    db = torch.cat([(b[k] - init[k]).flatten() for k in init])
    assert db.norm() > 0 and (da - db).norm() / db.norm() < 1e-3
    assert s_ddp["val_bits_per_byte"] == pytest.approx(s_one["val_bits_per_byte"], rel=1e-4)


def test_a_language_model_run_loads_from_a_path_under_the_home_folder(tmp_path, monkeypatch):
    """``load_model("~/runs/lm")`` (and ``lm sample --checkpoint ~/...`` quoted): ``~`` is the home folder, as for
    image runs (it was taken for a folder named ``~``: "no model.safetensors or last.pt there")."""
    import shutil
    from pathlib import Path

    import lambdanet

    fixture = Path(__file__).resolve().parent / "fixtures" / "lm_runs_fixed" / "lm_done"
    shutil.copytree(fixture, tmp_path / "runs" / "lm")
    monkeypatch.setenv("HOME", str(tmp_path))
    tokens = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(lambdanet.load_model("~/runs/lm")(tokens), lambdanet.load_model(fixture)(tokens))
