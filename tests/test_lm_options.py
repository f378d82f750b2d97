"""The causal lambda layer's options (issue 37): beyond the paper a fixed or data-dependent decay of the content
summary, a short causal convolution, multi-head lambdas and the hybrid language models; from the paper's ablations
position-only lambdas (Table 10), L2 or no key normalisation and softmax queries (Table 12). Each against a naive
float64 definition written out here position by position, with causality, state-continuation and one-line-error
checks.

Tolerances: float64 throughout; the layer and the definitions differ only in summation order (chunks, running
maxima, offsets accumulated as running sums), ``~(n + r) eps ~ 1e-14`` relative; the tests allow ``1e-10``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lambdanet.functional.causal import causal_lambda_reference
from lambdanet.layers.causal_lambda import CausalLambdaLayer
from lambdanet.models import create_model
from lambdanet.models.lm import LM_SIZES

OPTIONS = [{"decay": "fixed"}, {"decay": "gate"}, {"short_conv": 4}, {"decay": "gate", "short_conv": 3},
           {"lambdas": 2}, {"lambdas": 2, "decay": "gate", "short_conv": 3}, {"content": False},
           {"key_norm": "l2"}, {"key_norm": "none"}, {"query_softmax": True},
           {"key_norm": "l2", "lambdas": 2, "short_conv": 3, "query_softmax": True},
           {"content": False, "lambdas": 2}]  # fmt: skip


def rel(a, b):
    return float((a - b).norm() / b.norm())


def layer(seed=0, **kw):
    torch.manual_seed(seed)
    m = CausalLambdaLayer(24, heads=2, dim_k=4, dim_v=6, dim_u=2, r=5, chunk=8, **kw).double()
    with torch.no_grad():  # away from the identity / constant initialisations, so every term matters
        if m.gate is not None:
            m.gate.weight.normal_(0, 0.5)
        if m.decay_rate is not None:
            m.decay_rate.normal_(0, 1)
        if m.conv is not None:
            m.conv.weight.normal_(0, 0.5)
    return m


def definition(m: CausalLambdaLayer, x: torch.Tensor) -> torch.Tensor:
    """The layer's output written out: projections (through the short convolution as a sum over taps), then for
    each query ``n`` the content weights ``softmax_{m <= n}(K[m] - sum_{m < t <= n} g_t)`` per channel, the
    position lambdas, the queries applied, the output projection."""
    b, n, _ = x.shape
    qkv = m.qkv(x)  # b n c
    if m.conv is not None:
        s, w = m.short_conv, m.conv.weight[:, 0]  # c s
        padded = F.pad(qkv, (0, 0, s - 1, 0))
        qkv = sum(w[:, j] * padded[:, j : j + n] for j in range(s))
    h, k, v, u, L = m.heads, m.dim_k, m.dim_v, m.dim_u, m.lambdas
    kc = k if m.content else 0  # position-only lambdas have no keys
    q, keys, values = qkv.split([h * k, L * kc * u, L * v * u], dim=-1)
    q, keys, values = q.unflatten(-1, (h, k)), keys.unflatten(-1, (L, kc, u)), values.unflatten(-1, (L, v, u))
    if m.query_softmax:
        q = torch.exp(q) / torch.exp(q).sum(dim=-1, keepdim=True)
    # lambda l serves the queries' heads l h / L .. (l + 1) h / L - 1 with its own keys and values
    per = h // L
    heads = [lambda_outputs(m, x, q[:, :, i * per : (i + 1) * per], keys[:, :, i], values[:, :, i]) for i in range(L)]
    return m.proj(torch.cat(heads, dim=2).flatten(2))


def lambda_outputs(m: CausalLambdaLayer, x, q, keys, values) -> torch.Tensor:
    """One lambda's outputs ``[b, n, h', v]`` for its queries ``q [b, n, h', k]``, keys ``[b, n, k, u]`` and values
    ``[b, n, v, u]``, written out per position."""
    b, n, k, u = keys.shape
    if m.decay is None and m.content and m.key_norm == "softmax":
        return causal_lambda_reference(q, keys, values, m.emb)
    if m.decay == "fixed":
        g = F.softplus(m.decay_rate).expand(b, n, k, u)
    elif m.decay == "gate":
        g = F.softplus(m.gate(x)).unflatten(-1, (k, u))  # b n k u
    else:
        g = keys.new_zeros(b, n, k, u)
    out = []
    for i in range(n):
        forget = torch.stack([g[:, j + 1 : i + 1].sum(dim=1) for j in range(i + 1)], dim=1)  # b m k u
        K = keys[:, : i + 1] - forget  # b m k u
        if m.key_norm == "softmax":
            w = torch.softmax(K, dim=1)
        elif m.key_norm == "l2":  # each channel divided by its norm over the prefix
            w = K / (K * K).sum(dim=1, keepdim=True).sqrt()
        else:
            w = K
        lam = torch.einsum("bmku,bmvu->bkv", w, values[:, : i + 1])
        if not m.content:
            lam = q.new_zeros(b, q.shape[3], values.shape[2])  # b k v
        for j in range(min(m.r, i + 1)):
            lam = lam + torch.einsum("ku,bvu->bkv", m.emb[j], values[:, i - j])
        out.append(torch.einsum("bhk,bkv->bhv", q[:, i], lam))
    return torch.stack(out, dim=1)


@pytest.mark.parametrize("kw", OPTIONS)
def test_each_option_equals_its_definition(kw):
    m = layer(**kw)
    x = torch.randn(2, 21, 24, dtype=torch.float64)
    assert rel(m(x), definition(m, x)) < 1e-10


@pytest.mark.parametrize("kw", OPTIONS)
def test_each_option_is_causal_and_continues_its_state(kw):
    m = layer(**kw)
    x = torch.randn(2, 21, 24, dtype=torch.float64)
    y = m(x)
    x2 = x.clone()
    x2[:, 15:] += 1.0
    y2 = m(x2)
    # nothing before position 15 sees it (up to rounding: a chunk's shared maximum may change), everything after does
    assert rel(y2[:, :15], y[:, :15]) < 1e-12 and (y2[:, 15:] - y[:, 15:]).abs().amax(dim=-1).min() > 1e-6
    y1, s = m(x[:, :9], return_state=True)
    y2, s2 = m(x[:, 9:], s, return_state=True)
    assert rel(torch.cat([y1, y2], dim=1), y) < 1e-10
    state, steps = m.init_state(2, dtype=torch.float64), []
    for t in range(21):
        out, state = m.step(state, x[:, t])
        steps.append(out)
    assert rel(torch.stack(steps, dim=1), y) < 1e-10
    # the state's size does not depend on the context's length
    assert {key: t.shape for key, t in state.items()} == {key: t.shape for key, t in s.items()}


def test_a_decay_forgets_and_the_gate_follows_the_input():
    """With a fast fixed decay the content weights concentrate on the last positions (a token 10 back weighs
    ``exp(-10 g)`` relative), so an early input stops mattering; the gate's rates depend on ``x``."""
    m = CausalLambdaLayer(24, heads=2, dim_k=4, r=0, decay="fixed").double()
    with torch.no_grad():
        m.decay_rate.fill_(5.0)  # softplus(5) ~ 5: exp(-50) after 10 positions
    x = torch.randn(1, 30, 24, dtype=torch.float64)
    x2 = x.clone()
    x2[:, 0] += 3.0
    assert (m(x2) - m(x))[:, 15:].abs().max() < 1e-12 < (m(x2) - m(x))[:, 0].abs().max()
    g = layer(decay="gate")
    rates = F.softplus(g.gate(x))
    assert rates.std(dim=1).min() > 0


def test_bad_options_are_one_line_errors():
    for kw, match in (({"decay": "exp"}, "decay must be one of None, 'fixed', 'gate'"),
                      ({"lambdas": 3}, r"lambdas must divide heads=4 \(the queries are split among them\), got 3"),
                      ({"lambdas": 0}, "lambdas must be a positive int"),
                      ({"short_conv": -1}, "short_conv must be a non-negative int"),
                      ({"short_conv": True}, "short_conv must be a non-negative int"),
                      ({"content": False, "r": 0}, "content=False needs position lambdas: r must be >= 1"),
                      ({"content": 0}, "content must be True or False, got 0"),
                      ({"query_softmax": "yes"}, "query_softmax must be True or False"),
                      ({"key_norm": "layer"}, r"key_norm must be one of \['softmax', 'l2', 'none'\], got 'layer'"),
                      ({"decay": "gate", "key_norm": "l2"}, "decay='gate' needs the content lambdas' prefix softmax"),
                      ({"decay": "fixed", "content": False}, "decay='fixed' needs"),
                      ({"r": True}, r"r must be a non-negative int \(0: content lambdas only\), got True"),
                      ):  # fmt: skip
        with pytest.raises(ValueError, match=match) as err:
            CausalLambdaLayer(24, **kw)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="attention_every must be a positive int"):
        create_model("hybrid_lm_nano", attention_every=0)


def test_options_a_family_has_no_use_for_are_refused_and_old_records_of_them_dropped():
    """The linear mixer has no position lambdas (``r``, ``content=False`` would leave it nothing), a hybrid with
    ``attention_every`` above its depth no attention block, a rotary transformer no length limit: each is a one-line
    error instead of a model that silently ignores it (``linear_lm_nano r=8`` built the same 116,992 weights as
    ``r=500``). A run that recorded one of them (it trained without it) loads as the model it trained."""
    from lambdanet.models import model_args
    from lambdanet.models.lm_zoo import saved_lm

    depth = len(create_model("hybrid_lm_tiny").blocks)
    for name, kw, match in (("linear_lm_nano", {"r": 8}, r"does not take \['r'\]"),
                            ("linear_lm_nano", {"content": False}, r"does not take \['content'\]"),
                            ("hybrid_lm_tiny", {"attention_every": depth + 1},
                             f"^attention_every must be at most depth={depth} .*got {depth + 1}"),
                            ("transformer_lm_nano", {"max_len": 16}, "^max_len is for the transformer's positions="),
                            ):  # fmt: skip
        with pytest.raises(ValueError, match=match) as err:
            create_model(name, **kw)
        assert "\n" not in str(err.value)
    assert "r" not in model_args("linear_lm_tiny") and "r" in model_args("hybrid_lm_tiny")
    hybrid = create_model("hybrid_lm_tiny", attention_every=depth)  # the last block attends
    assert [type(b.mixer).__name__ == "CausalSelfAttention" for b in hybrid.blocks] == [False] * (depth - 1) + [True]
    assert saved_lm("linear_lm_tiny", {"r": 8, "content": True, "dim_u": 2}) == ("linear_lm_tiny", {"dim_u": 2})
    assert saved_lm("transformer_lm_nano", {"max_len": 16}) == ("transformer_lm_nano", {})
    kept = {"positions": "learned", "max_len": 16}
    assert saved_lm("transformer_lm_nano", kept) == ("transformer_lm_nano", kept)
    assert saved_lm("hybrid_lm_tiny", {"r": 8}) == ("hybrid_lm_tiny", {"r": 8})
    plain = saved_lm("hybrid_lm_tiny", {"attention_every": depth + 1, "r": 8})  # recorded before it was refused
    assert plain == ("plain_lambda_lm_tiny", {"r": 8})
    assert not any(type(b.mixer).__name__ == "CausalSelfAttention" for b in create_model(plain[0], **plain[1]).blocks)


def test_bad_inputs_and_states_are_one_line_errors_in_forward_step_and_init_state():
    """What the projection or the op would reject deep inside (torch's shape, dtype or key errors), named at the
    layer's entry: ``x``'s layout and dtype, a state of another batch size or layer (in ``forward`` and in ``step``,
    before any kernel reads it), ``init_state``'s batch size. Autocast's mixed dtypes stay accepted."""
    layer = CausalLambdaLayer(32, heads=4, dim_k=8, r=4, short_conv=3)
    state = layer.init_state(2)
    other = CausalLambdaLayer(32, heads=4, dim_k=8, r=6).init_state(2)
    cases = [
        (lambda: layer.step(state, torch.randn(3, 32)), r"^state does not fit a batch of 3 in this layer: S \(2, "),
        (lambda: layer.step(state, torch.randn(2, 16)), r"^x must be a floating-point tensor \[batch, dim=32\], got "),
        (lambda: layer.step(state, torch.randn(2, 1, 32)), r"\[batch, dim=32\], got shape \(2, 1, 32\)"),
        (lambda: layer.step(other, torch.randn(2, 32)), r"^state must be this layer's state \(keys \['S', 'c', 'conv'"),
        (lambda: layer(torch.randn(2, 5, 32), other), r"^state must be this layer's state"),
        (lambda: layer(torch.ones(2, 8, 32, dtype=torch.long)), r"\[batch, length, dim=32\], got shape .*int64"),
        (lambda: layer(torch.randn(2, 8, 32).numpy()), r"\[batch, length, dim=32\], got ndarray"),
        (lambda: layer(torch.randn(2, 8, 32, dtype=torch.float64)),
         r"^CausalLambdaLayer's parameters are float32 but its input is float64: cast the input, or the layer with"),
        (lambda: layer.init_state(-1), r"^batch_size must be a non-negative int, got -1"),
        (lambda: layer.init_state("2"), r"^batch_size must be a non-negative int, got '2'"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match) as err:
            call()
        assert "\n" not in str(err.value)
    import numpy as np  # a batch size numpy gives (as the attention layer's init_state takes it): the same state

    assert {k: t.shape for k, t in layer.init_state(np.int64(2)).items()} == {k: t.shape for k, t in state.items()}
    with torch.autocast("cpu", dtype=torch.bfloat16):  # float32 parameters meet a bf16 input under autocast
        y, after = layer(torch.randn(2, 8, 32, dtype=torch.bfloat16), return_state=True)
        layer.step(after, torch.randn(2, 32, dtype=torch.bfloat16))
    assert y.shape == (2, 8, 32)


@pytest.mark.parametrize("size", sorted(LM_SIZES))
def test_hybrid_models_match_the_families_size_and_place_attention_last_in_each_group(size):
    counts = {m: sum(p.numel() for p in create_model(f"{m}_lm_{size}").parameters()) for m in ("hybrid", "transformer")}
    assert abs(counts["hybrid"] / counts["transformer"] - 1) < 0.02
    model = create_model(f"hybrid_lm_{size}")
    kinds = [type(b.mixer).__name__ for b in model.blocks]
    every = 2 if size == "nano" else 4
    assert kinds == ["CausalSelfAttention" if (i + 1) % every == 0 else "CausalLambdaLayer" for i in range(len(kinds))]


@pytest.mark.parametrize("name,kw", [("hybrid_lm_nano", {}), ("lambda_lm_nano", {"decay": "gate", "short_conv": 3}),
                                     ("lambda_lm_nano", {"content": False}),
                                     ("lambda_lm_nano", {"key_norm": "l2", "query_softmax": True})])
def test_a_models_steps_equal_its_parallel_forward(name, kw):
    torch.manual_seed(0)
    model = create_model(name, **kw).double().eval()
    tokens = torch.randint(0, 256, (2, 20))
    full = model(tokens)
    _, state = model(tokens[:, :12], return_state=True)
    steps = []
    for t in range(12, 20):
        logits, state = model.step(state, tokens[:, t])
        steps.append(logits)
    assert rel(torch.stack(steps, dim=1), full[:, 12:]) < 1e-10


def test_the_fixed_decays_rates_take_no_weight_decay():
    """``decay_rate`` (one per layer) sits in the group without weight decay, the rest of the mixer (its
    projections, its convolution, the gate's weights) in the one with it: one AdamW step with zero gradients
    leaves the rates as they were and shrinks a projection by ``1 - lr wd`` exactly."""
    from lambdanet.engine.optim import param_groups

    model = create_model("lambda_lm_nano")  # the default: a fixed decay and a convolution
    groups = param_groups(model, 0.1)
    name = {id(p): n for n, p in model.named_parameters()}
    decayed, kept = ({name[id(p)] for p in g["params"]} for g in groups)
    rates = {n for n in name.values() if n.endswith("mixer.decay_rate")}
    assert len(rates) == LM_SIZES["nano"].depth and rates <= kept
    assert {"blocks.0.mixer.qkv.weight", "blocks.0.mixer.conv.weight"} <= decayed
    gated = create_model("lambda_lm_nano", decay="gate")
    gate_name = {id(p): n for n, p in gated.named_parameters()}
    gate_decayed = {gate_name[id(p)] for p in param_groups(gated, 0.1)[0]["params"]}
    assert "blocks.0.mixer.gate.weight" in gate_decayed and not any("decay_rate" in n for n in gate_name.values())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(groups, lr=0.01)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    after = dict(model.named_parameters())
    assert all(torch.equal(after[n], before[n]) for n in rates)
    w = "blocks.0.mixer.qkv.weight"
    assert torch.allclose(after[w], before[w] * (1 - 0.01 * 0.1), rtol=1e-6, atol=0)


def test_an_optimiser_saved_while_the_rates_took_weight_decay_resumes_with_each_parameters_state():
    """A checkpoint of a ``decay="fixed"`` model from before the rates left weight decay grouped its parameters
    by dimension alone: loaded, every parameter (the rates included, now in the other group) gets its own
    moments back, and the rates' group has no weight decay."""
    from lambdanet.engine.optim import load_optimizer_state, param_groups

    torch.manual_seed(0)
    model = create_model("lambda_lm_nano")
    params = list(model.parameters())
    old = torch.optim.AdamW([{"params": [p for p in params if p.ndim > 1], "weight_decay": 0.1},
                             {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}], lr=0.01)  # fmt: skip
    for p in params:
        p.grad = torch.randn_like(p)
    old.step()
    new = torch.optim.AdamW(param_groups(model, 0.1), lr=0.01)
    load_optimizer_state(new, old.state_dict(), model)
    for p in params:
        assert torch.equal(new.state[p]["exp_avg"], old.state[p]["exp_avg"])
    rates = [p for n, p in model.named_parameters() if n.endswith("decay_rate")]
    assert all(any(r is p for p in new.param_groups[1]["params"]) for r in rates)
    assert new.param_groups[1]["weight_decay"] == 0.0


def test_under_autocast_the_lambdas_output_goes_to_proj_without_a_round_trip():
    """Under autocast ``proj`` casts its input itself: the layer hands it the op's bf16 output as it is, not cast to
    the float32 residual stream's dtype first (4 copies of ``[b, n, h v]`` per layer and step, ~6% of a
    ``lambda_lm_base`` step on an H100). The result is bitwise the old one (bf16 -> float32 -> bf16 is exact), and
    outside autocast the output keeps ``x``'s dtype."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    layer = CausalLambdaLayer(64, heads=4, dim_k=16, dim_v=24, r=8, decay="fixed", short_conv=4)
    x = torch.randn(2, 40, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            out = layer(x)
    hv = [2, 40, 4 * 24]  # b n (h v): the lambdas' output
    casts = [e for e in prof.events() if e.name == "aten::copy_" and e.input_shapes and e.input_shapes[0] == hv]
    assert casts == []
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the old path: cast to x's dtype, then proj casts it back
        qkv, _ = layer._project(x, None)
        q, keys, values = layer._split(qkv)
        keys, _ = layer._offsets(x, keys)
        q, keys, values = layer._fold(q, keys, values)
        from lambdanet.ops import causal_lambda

        yb = causal_lambda(q, keys, values, layer.emb, mode="chunk", chunk_size=layer.chunk)
        old = layer.proj(layer._unfold(yb).to(x.dtype))
    assert out.dtype == old.dtype == torch.bfloat16 and torch.equal(out, old)
    assert layer(x).dtype == torch.float32


def test_the_language_models_keep_the_gates_own_initialisation():
    """The models' GPT-2 initialisation of their linear layers leaves the gate as the layer documents it (zero
    weights, the fixed decay's rates ``2^-9 .. 2^-5`` as its bias: it starts as the fixed decay), where it reset
    the gate to random weights and a zero bias (a rate of 0.69 per position); every other weight is as before."""
    torch.manual_seed(0)
    model = create_model("lambda_lm_nano", decay="gate")
    alone = CausalLambdaLayer(64, 2, decay="gate")  # the layer's own initialisation, the independent expectation
    for block in model.blocks:
        gate = block.mixer.gate
        assert torch.equal(gate.weight, torch.zeros_like(gate.weight)) and torch.equal(gate.bias, alone.gate.bias)
    rates = F.softplus(model.blocks[0].mixer.gate.bias.detach().double())
    k = rates.numel()
    # the bias is the inverse softplus in float32: |b| < 8, so a few ulps of float32 log / expm1 (2^-21 each at that
    # magnitude) make an absolute error of ~1e-6 in b, the same relative error in softplus(b) ~ exp(b); 16 ulps' worth
    rtol = 16 * 8 * torch.finfo(torch.float32).eps
    torch.testing.assert_close(rates, torch.logspace(-9, -5, k, base=2.0, dtype=torch.float64), rtol=rtol, atol=0)


@pytest.mark.parametrize("kwargs", [{}, {"key_norm": "l2"}, {"content": False}])
def test_truncated_backprop_through_returned_states(kwargs):
    """A state carries no autograd history (as the docs say: it receives no gradient): a training loop that backs
    up through each piece of a stream and carries the state on works, with the short convolution's projections in
    the state too (the default ``lambda_lm_*``'s), and the terms apart (``key_norm``, ``content=False``)."""
    torch.manual_seed(0)
    layer = CausalLambdaLayer(16, heads=2, dim_k=4, r=3, short_conv=3, **kwargs)
    state = None
    for piece in torch.randn(3, 2, 5, 16):
        y, state = layer(piece, state, return_state=True)
        y.square().sum().backward()  # raised on the second piece: the convolution's state kept the first's graph
        assert not any(t.requires_grad for t in state.values())
    for name in ("lambda_lm_nano", "hybrid_lm_nano", "transformer_lm_nano"):  # the attention's cache too
        model = create_model(name)
        state = model.init_state(2)
        for piece in torch.randint(0, 256, (2, 2, 6)):
            logits, state = model(piece, state, return_state=True)
            logits.logsumexp(-1).sum().backward()


def test_a_language_models_state_and_sizes_are_checked_in_one_line():
    model = create_model("lambda_lm_nano").eval()
    tokens = torch.randint(0, 256, (1, 4))
    state = model.init_state(1)
    short = {"position": state["position"], "layers": state["layers"][:1]}  # skipped a block silently
    with pytest.raises(ValueError, match=r"^state\['layers'\] must hold 2 layer states \(one per block\), got 1$"):
        model(tokens, short)
    with pytest.raises(ValueError, match=r"^state\['layers'\] must hold 2 layer states"):
        model.step(short, tokens[:, 0])
    with pytest.raises(ValueError, match=r"^state must be this model's state \(a dict of 'position' and 'layers'"):
        model(tokens, {"layers": state["layers"]})
    with pytest.raises(ValueError, match=r"^dtype must be a floating-point dtype \(the state is float32 or wider\)"):
        model.blocks[0].mixer.init_state(1, dtype=torch.long)  # was a float32 state, silently
    for ratio in (-1.0, "4", 0.001):
        with pytest.raises(ValueError, match=r"^mlp_ratio must be a number > 0 with dim \* mlp_ratio >= 1"):
            create_model("lambda_lm_nano", mlp_ratio=ratio)


def test_the_attention_layers_cache_and_options_are_checked_in_one_line():
    """The transformer's mixer checks what the lambda layer checks: its options, the cache's keys, shape, dtype and
    device against ``x``; a cache of another floating dtype (made outside autocast) is used in the call's dtype."""
    from lambdanet.layers import CausalSelfAttention

    torch.manual_seed(0)
    attn = CausalSelfAttention(16, heads=2)
    x = torch.randn(2, 5, 16)
    cases = [
        (lambda: attn(x, attn.init_state(3)), r"^state\['k'\] must be \[batch=2, heads=2, length, 8\]"),
        (lambda: attn(x, {"k": torch.zeros(2, 2, 0, 8)}), r"^state must be this layer's KV cache \(keys \['k', 'v'\]"),
        (lambda: attn(x.long()), r"^x must be a floating-point tensor \[batch, length, dim=16\]"),
        (lambda: attn.step(attn.init_state(2), torch.randn(2, 17)), r"^x must be a floating-point tensor \[batch, dim"),
        (lambda: attn.init_state(-1), r"^batch_size must be a non-negative int, got -1$"),
        (lambda: attn.init_state(2, dtype=torch.long), r"^dtype must be a floating-point dtype"),
        (lambda: CausalSelfAttention(16, rotary="no"), r"^rotary must be True or False, got 'no'$"),
    ]
    for build, message in cases:
        with pytest.raises(ValueError, match=message):
            build()
    with torch.no_grad():
        assert torch.equal(attn(x, attn.init_state(2, dtype=torch.float64)), attn(x))  # an empty cache: as none
        first, cache = attn(x[:, :3], return_state=True)
        wide = {key: t.double() for key, t in cache.items()}  # exact: float32 values widened
        assert torch.equal(attn(x[:, 3:], wide), attn(x[:, 3:], cache))
        assert attn(x[:, 3:], wide, return_state=True)[1]["k"].dtype == torch.float64  # the cache keeps its dtype
        with torch.autocast("cpu", dtype=torch.bfloat16):  # a float32 cache stays float32 under autocast
            assert attn(x[:, 3:], cache, return_state=True)[1]["k"].dtype == torch.float32
    with pytest.raises(ValueError, match=r"^dtype must be a floating-point dtype"):
        attn.init_state(2, dtype="float16")
