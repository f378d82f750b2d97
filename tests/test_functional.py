"""The functional core against naive per-query loops written from Eq. 1-2 of the paper."""

import itertools
import math

import pytest
import torch

from lambdanet import functional as LF

# float32 results against float64 loops on the same float32 inputs: each output sums L <= 90 products (the
# position lambdas of a 5x3x3 scope over u = 2), and sum |terms| reaches 56 here (standard normal inputs); the
# float32 rounding errors, random in sign, add to about sqrt(L) * 2^-24 * sum|terms| ~ 3e-5 (the linear worst case
# L * 2^-24 * sum|terms| ~ 3e-4 needs every rounding aligned). 1e-4 is ~3 times the former; the errors measured
# (AVX2 and ATEN_CPU_CAPABILITY=default kernels) stay below 1/50 of the tolerance; a wrong term is off by O(1)
ATOL = 1e-4


def naive_lambda(queries, normalized_keys, embeddings, values, mask=None):
    """Eq. 1-2 with explicit loops: lambda_n = sum_m (kbar_m + e_nm) v_m^T, y_n = concat_h lambda_n^T q_n^h.

    queries [b,h,n,k], normalized_keys [b,m,k], embeddings [n,m,k], values [b,m,v], mask [n,m] or None.
    """
    b, h, n, k = queries.shape
    m, v = values.shape[1], values.shape[2]
    out = torch.zeros(b, n, h * v, dtype=torch.float64)
    for bi in range(b):
        for ni in range(n):
            lam = torch.zeros(k, v, dtype=torch.float64)
            for mi in range(m):
                if mask is not None and mask[ni, mi] == 0:
                    continue
                lam += torch.outer(normalized_keys[bi, mi] + embeddings[ni, mi], values[bi, mi]).double()
            out[bi, ni] = torch.cat([lam.t() @ queries[bi, hi, ni].double() for hi in range(h)])
    return out


def test_lambda_layer_matches_naive_loop():
    b, h, n, m, k, v = 2, 3, 5, 7, 4, 6
    q, keys = torch.randn(b, h, n, k), torch.randn(b, m, k)
    emb, vals = torch.randn(n, m, k), torch.randn(b, m, v)
    out = LF.lambda_layer(q, keys, emb, vals)
    ref = naive_lambda(q, keys.softmax(dim=1), emb, vals)
    assert out.shape == (b, n, h * v)
    torch.testing.assert_close(out.double(), ref, atol=ATOL, rtol=1e-4)


def test_lambda_layer_intra_depth_matches_naive_loop():
    """Fig. 8: keys/embeddings k x u, values v x u, summed over u."""
    b, h, n, m, k, v, u = 2, 2, 4, 6, 3, 5, 3
    q, keys = torch.randn(b, h, n, k), torch.randn(b, m, k, u)
    emb, vals = torch.randn(n, m, k, u), torch.randn(b, m, v, u)
    out = LF.lambda_layer(q, keys, emb, vals)
    kbar = keys.softmax(dim=1)
    ref = torch.zeros(b, n, h * v, dtype=torch.float64)
    for bi, ni in itertools.product(range(b), range(n)):
        lam = sum(torch.outer(kbar[bi, mi, :, ui] + emb[ni, mi, :, ui], vals[bi, mi, :, ui]).double()
                  for mi in range(m) for ui in range(u))
        ref[bi, ni] = torch.cat([lam.t() @ q[bi, hi, ni].double() for hi in range(h)])
    torch.testing.assert_close(out.double(), ref, atol=ATOL, rtol=1e-4)


def test_masked_lambda_layer_matches_naive_loop():
    b, h, n, k, v = 2, 2, 6, 3, 4
    q, keys = torch.randn(b, h, n, k), torch.randn(b, n, k)
    emb, vals = torch.randn(k, n, n), torch.randn(b, n, v)
    mask = (torch.rand(n, n) > 0.4).float()
    out = LF.masked_lambda_layer(q, keys, emb, vals, mask)
    ref = naive_lambda(q, keys, emb.permute(1, 2, 0), vals, mask)
    torch.testing.assert_close(out.double(), ref, atol=ATOL, rtol=1e-4)


def test_multihead_lambda_layer_matches_naive_loop():
    b, h, n, m, k, v = 2, 3, 4, 5, 3, 4
    q, keys = torch.randn(b, h, n, k), torch.randn(b, h, m, k)
    emb, vals = torch.randn(h, n, m, k), torch.randn(b, h, m, v)
    out = LF.multihead_lambda_layer(q, keys, emb, vals)
    kbar = keys.softmax(dim=2)
    ref = torch.zeros(b, n, h * v, dtype=torch.float64)
    for bi, ni in itertools.product(range(b), range(n)):
        heads = []
        for hi in range(h):  # one lambda per head
            lam = sum(torch.outer(kbar[bi, hi, mi] + emb[hi, ni, mi], vals[bi, hi, mi]).double() for mi in range(m))
            heads.append(lam.t() @ q[bi, hi, ni].double())
        ref[bi, ni] = torch.cat(heads)
    torch.testing.assert_close(out.double(), ref, atol=ATOL, rtol=1e-4)


def naive_masked_embeddings_1d(R, n):
    """E[n, m] = R[m - n + r // 2] inside the scope, 0 outside (R: [r, k])."""
    r, k = R.shape
    E = torch.zeros(n, n, k)
    for ni in range(n):
        for mi in range(n):
            off = mi - ni + r // 2
            if 0 <= off < r:
                E[ni, mi] = R[off]
    return E


@pytest.mark.parametrize("impl", ["conv", "depthwise_conv"])
def test_compute_position_lambdas_conv_equals_einsum_with_masked_embeddings(impl):
    b, n, k, v, r = 2, 11, 4, 3, 5
    R, vals = torch.randn(r, k), torch.randn(b, n, v)
    conv = LF.compute_position_lambdas(R, vals, impl=impl)
    ein = LF.compute_position_lambdas(naive_masked_embeddings_1d(R, n), vals, impl="einsum")
    assert conv.shape == (b, n, k, v)
    torch.testing.assert_close(conv, ein, atol=ATOL, rtol=1e-4)


def test_compute_position_lambdas_intra_depth():
    b, n, k, v, u, r = 2, 9, 3, 4, 2, 3
    R, vals = torch.randn(r, k, u), torch.randn(b, n, v, u)
    E = torch.stack([naive_masked_embeddings_1d(R[..., i], n) for i in range(u)], dim=-1)  # n m k u
    ein = LF.compute_position_lambdas(E, vals, impl="einsum")
    for impl in ("conv", "depthwise_conv"):
        torch.testing.assert_close(LF.compute_position_lambdas(R, vals, impl=impl), ein, atol=ATOL, rtol=1e-4)


def naive_position_lambdas_nd(values, kernel, center):
    """lambda^p[b,g,v,k,x] = sum_{o,u} R[g,k,u,center+o] V[b,g,v,u,x+o] with explicit loops over x and o."""
    b, g, v, u = values.shape[:4]
    spatial = values.shape[4:]
    k = kernel.shape[1]
    ksize = kernel.shape[3:]
    out = torch.zeros(b, g, v, k, *spatial, dtype=torch.float64)
    for x in itertools.product(*[range(s) for s in spatial]):
        for t in itertools.product(*[range(s) for s in ksize]):
            y = tuple(xi + ti - ci for xi, ti, ci in zip(x, t, center))
            if not all(0 <= yi < s for yi, s in zip(y, spatial)):
                continue
            w = kernel[(slice(None), slice(None), slice(None)) + t].double()  # g k u
            val = values[(slice(None),) * 4 + y].double()  # b g v u
            out[(slice(None),) * 4 + x] += torch.einsum("gku,bgvu->bgvk", w, val)
    return out


@pytest.mark.parametrize(
    "spatial,ksize,causal,g,u",
    [
        ((13,), (5,), False, 1, 1),
        ((13,), (4,), True, 1, 2),
        ((6, 7), (3, 5), False, 1, 1),
        ((5, 4), (5, 5), False, 2, 1),
        ((5, 6), (7, 3), False, 1, 3),
        ((3, 4, 5), (3, 3, 3), False, 1, 1),
        ((3, 4, 4), (5, 3, 3), False, 2, 2),
        ((4, 5), (9, 9), False, 1, 1),  # scope larger than the input: cropped
    ],
)
def test_position_lambda_impls_agree_with_naive_loop(spatial, ksize, causal, g, u):
    b, v, k = 2, 3, 4
    values = torch.randn(b, g, v, u, *spatial)
    kernel = torch.randn(g, k, u, *ksize)
    center = tuple(s - 1 if causal else s // 2 for s in ksize)
    ref = naive_position_lambdas_nd(values, kernel, center)
    for impl in LF.POSITION_IMPLS:
        out = LF.position_lambdas(values, kernel, center, impl)
        assert out.shape == (b, g, v, k, *spatial), impl
        torch.testing.assert_close(out.double(), ref, atol=ATOL, rtol=1e-4, msg=impl)


def test_gather_relative_embeddings_matches_definition():
    kernel = torch.randn(1, 3, 1, 5, 3)  # g k u K0 K1
    center = (2, 1)
    spatial = (4, 3)
    E = LF.gather_relative_embeddings(kernel, center, spatial)  # g k u n m
    assert E.shape == (1, 3, 1, 12, 12)
    pos = list(itertools.product(range(4), range(3)))
    for ni, (i, j) in enumerate(pos):
        for mi, (a, c) in enumerate(pos):
            t0, t1 = a - i + 2, c - j + 1
            want = kernel[0, :, 0, t0, t1] if 0 <= t0 < 5 and 0 <= t1 < 3 else torch.zeros(3)
            torch.testing.assert_close(E[0, :, 0, ni, mi], want)


@pytest.mark.parametrize("method", ["softmax", "l2", "none"])
def test_causal_content_lambdas_match_per_query_normalisation(method):
    b, n, g, k, v, u = 2, 7, 1, 3, 4, 2
    keys, vals = torch.randn(b, n, g, k, u) * 3, torch.randn(b, n, g, v, u)
    out = LF.causal_content_lambdas(keys, vals, method)
    assert out.shape == (b, n, g, k, v)
    for ni in range(n):
        ctx = keys[:, : ni + 1]  # each query normalises over its own context only
        if method == "softmax":
            kbar = ctx.softmax(dim=1)
        elif method == "l2":
            kbar = ctx / ctx.norm(dim=1, keepdim=True)
        else:
            kbar = ctx
        want = torch.einsum("bmgku,bmgvu->bgkv", kbar, vals[:, : ni + 1])
        torch.testing.assert_close(out[:, ni], want, atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("n", [1, 31, 33, 100])
def test_causal_content_lambdas_normalise_by_each_querys_own_context_whatever_comes_later(n):
    """A key 300 nats above the earlier ones (float32's exp spans ~87): shifting by the whole sequence's maximum
    underflowed the earlier queries' weights to 0 (a later key changed earlier outputs). Against the per-query
    softmax in float64 (rounding ~1e-15 of values ~1)."""
    keys = torch.randn(2, n, 2, 4, 3, dtype=torch.float64) * 5
    keys[:, n // 2 :] += 300.0
    vals = torch.randn(2, n, 2, 6, 3, dtype=torch.float64)
    want = torch.stack([torch.einsum("bmgku,bmgvu->bgkv", keys[:, : t + 1].softmax(dim=1), vals[:, : t + 1])
                        for t in range(n)], dim=1)  # fmt: skip
    torch.testing.assert_close(LF.causal_content_lambdas(keys, vals, "softmax"), want, atol=1e-12, rtol=1e-12)
    # float32: rounding a key of ~300 moves its weight by up to 300 x 2^-24 relative; a weighted mean of values
    # <= max|V| over 3 channels u then moves by up to 2 x 3 x that x max|V| (the old shift gave errors ~max|V|)
    low = LF.causal_content_lambdas(keys.float(), vals.float(), "softmax")
    bound = 2 * 3 * float(keys.abs().max()) * 2**-24 * float(vals.abs().max())
    torch.testing.assert_close(low.double(), want, atol=bound, rtol=0)


def test_causal_content_lambdas_of_a_masked_prefix_are_zero_then_the_softmax():
    """Keys of -inf (left padding masked out) weigh nothing: the lambdas before the first finite key are 0, the
    later ones the per-query softmax over the finite keys (the shift used to make -inf - -inf = NaN everywhere)."""
    keys = torch.randn(1, 80, 1, 3, 1, dtype=torch.float64)
    keys[:, :40] = float("-inf")
    vals = torch.randn(1, 80, 1, 4, 1, dtype=torch.float64)
    out = LF.causal_content_lambdas(keys, vals, "softmax")
    want = torch.stack([torch.einsum("bmgku,bmgvu->bgkv", keys[:, 40 : t + 1].softmax(dim=1), vals[:, 40 : t + 1])
                        for t in range(40, 80)], dim=1)  # fmt: skip
    assert torch.equal(out[:, :40], torch.zeros_like(out[:, :40]))
    torch.testing.assert_close(out[:, 40:], want, atol=1e-12, rtol=1e-12)


def test_causal_content_lambdas_stay_finite_for_large_keys():
    keys = torch.randn(1, 64, 1, 4, 1) * 40  # key range far beyond exp's fp32 range
    out = LF.causal_content_lambdas(keys, torch.randn(1, 64, 1, 3, 1), "softmax")
    assert torch.isfinite(out).all()


def test_apply_lambdas_multiquery_and_multihead():
    b, n, h, k, v = 2, 5, 3, 4, 6
    q = torch.randn(b, n, h, k)
    lam1 = torch.randn(b, n, 1, v, k)
    torch.testing.assert_close(LF.apply_lambdas(q, lam1), torch.einsum("bnhk,bnvk->bnhv", q, lam1[:, :, 0]))
    lamh = torch.randn(b, n, h, v, k)
    torch.testing.assert_close(LF.apply_lambdas(q, lamh), torch.einsum("bnhk,bnhvk->bnhv", q, lamh))


@pytest.mark.parametrize(
    "call,needle",
    [
        (lambda: LF.lambda_layer(torch.randn(2, 4, 5, 3), torch.randn(2, 6, 3), torch.randn(5, 6, 3),
                                 torch.randn(3, 6, 8)), "values has b=3"),
        (lambda: LF.lambda_layer(torch.randn(2, 4, 5), torch.randn(2, 6, 3), torch.randn(5, 6, 3),
                                 torch.randn(2, 6, 8)), "queries must have shape [b, h, n, k]"),
        (lambda: LF.lambda_layer(torch.randn(2, 4, 5, 3), torch.randn(2, 6, 3), torch.randn(5, 7, 3),
                                 torch.randn(2, 6, 8)), "embeddings has m=7"),
        (lambda: LF.compute_position_lambdas(torch.randn(4, 3), torch.randn(2, 9, 5), impl="conv"), "odd scope"),
        (lambda: LF.compute_position_lambdas(torch.randn(5, 3), torch.randn(2, 9, 5), impl="fft"), "impl must be"),
        (lambda: LF.masked_lambda_layer(torch.randn(1, 2, 4, 3), torch.randn(1, 4, 3), torch.randn(3, 4, 4),
                                        torch.randn(1, 4, 5), torch.ones(4, 5)), "mask has m=5"),
        (lambda: LF.relative_position_output_qe(torch.randn(1, 12, 2, 3), torch.randn(1, 4, 1, 5, 5), (2, 2),
                                                (3, 4), torch.randn(1, 12, 5)), "kernel must be [1, k=3, 1, *K]"),
        (lambda: LF.relative_position_output_qe(torch.randn(1, 12, 2, 3), torch.randn(1, 3, 1, 5, 5), (2, 2),
                                                (3, 5), torch.randn(1, 12, 5)), "n = m = prod(spatial) = 15"),
        # the fast path's building blocks (lambdanet.functional re-exports them) name their arguments too
        (lambda: LF.position_output_qe(torch.randn(2, 6, 3, 4), torch.randn(4, 9, 6), torch.randn(2, 6, 5)),
         "queries [b, n, h, k], embeddings [k, n, m] and values [b, m, v] must agree, got (2, 6, 3, 4), (4, 9, 6)"),
        (lambda: LF.position_output_qe(torch.randn(2, 6, 3, 4), torch.randn(4, 6, 6), torch.randn(3, 6, 5)),
         "got (2, 6, 3, 4), (4, 6, 6) and (3, 6, 5)"),
        (lambda: LF.position_output_qe(torch.randn(2, 6, 3, 4), torch.randn(4, 6, 6), torch.randn(2, 6)),
         "and (2, 6)"),
        (lambda: LF.position_output_qe(torch.randn(6, 3, 4), torch.randn(4, 6, 6), torch.randn(2, 6, 5)),
         "got (6, 3, 4)"),
        (lambda: LF.content_lambda(torch.randn(2, 6, 8), torch.randn(2, 7, 5)),
         "normalized_keys must have shape [b, m, g, k, u], got shape (2, 6, 8)"),
        (lambda: LF.content_lambda(torch.randn(2, 6, 1, 8, 1), torch.randn(2, 7, 1, 5, 1)),
         "values has m=7 but normalized_keys has m=6"),
        (lambda: LF.causal_content_lambdas(torch.randn(2, 6, 1, 8, 1), torch.randn(2, 7, 1, 5, 1)),
         "values has n=7 but keys has n=6"),
        (lambda: LF.apply_content_lambda(torch.randn(2, 4, 6, 8), torch.randn(2, 9, 5)),
         "lam must have shape [b, g, k, v]"),
        (lambda: LF.apply_content_lambda(torch.randn(2, 4, 6, 8), torch.randn(2, 3, 8, 5)),
         "lam must have g = 1 or g = h = 6 lambdas"),
        (lambda: LF.apply_lambdas(torch.randn(2, 6, 4, 8), torch.randn(2, 6, 1, 5, 9)), "lambdas has k=9 but queries"),
        (lambda: LF.apply_lambdas(torch.randn(2, 6, 4, 8), torch.randn(2, 6, 3, 5, 8)), "g = 1 or g = h = 4"),
        (lambda: LF.position_lambdas(torch.randn(2, 2, 5, 1, 6, 6), torch.randn(1, 8, 1, 3, 3), center=(1, 1),
                                     impl="conv"), "must agree on g, u and the spatial rank"),
        (lambda: LF.position_lambdas(torch.randn(2, 1, 5, 1, 6, 6), torch.randn(1, 8, 1, 3, 3), center=(1,),
                                     impl="conv"), "center must give one tap of each of the kernel's 2 spatial axes"),
        (lambda: LF.position_lambdas(torch.randn(2, 1, 5, 1, 6, 6), torch.randn(1, 8, 1, 3, 3), center=(5, 5),
                                     impl="einsum"), "got center=(5, 5)"),
        (lambda: LF.crop_relative_kernel(torch.randn(1, 8, 1, 3, 3), (1, 1), (0, 0)), "spatial must be positive"),
        (lambda: LF.normalize_keys(torch.randn(2, 6, 8), "softmax", dim=5), "dim must be an axis of the keys"),
        (lambda: LF.lambda_layer(torch.randn(2, 4, 6, 8), [[1.0]], torch.randn(6, 6, 8), torch.randn(2, 6, 5)),
         "keys must be a tensor, got list"),
    ],
)
def test_functional_bad_shapes_raise_value_error_naming_argument(call, needle):
    with pytest.raises(ValueError) as err:
        call()
    assert needle in str(err.value)


@pytest.mark.parametrize("chunk", [None, 7, 1])
def test_queries_first_position_output_equals_lambdas_first(chunk):
    """(q E) V in query chunks == q (E V), values and gradients."""
    b, n, m, h, k, v = 2, 10, 12, 3, 4, 5
    q = torch.randn(b, n, h, k, dtype=torch.float64, requires_grad=True)
    emb = torch.randn(k, n, m, dtype=torch.float64, requires_grad=True)
    vals = torch.randn(b, m, v, dtype=torch.float64, requires_grad=True)
    out = LF.position_output_qe(q, emb, vals, max_chunk_elements=None if chunk is None else chunk * b * h * m)
    ref = torch.einsum("bnhk,bnkv->bhnv", q, torch.einsum("knm,bmv->bnkv", emb, vals))
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, emb, vals), g)
    ref_grads = torch.autograd.grad(ref, (q, emb, vals), g)
    for a, r in zip(grads, ref_grads):
        torch.testing.assert_close(a, r)


def naive_relative_embeddings(kernel, center, spatial):
    """E[k, n, m] = R[k, m - n + center] inside the kernel, else 0, by looping over position pairs."""
    k = kernel.shape[1]
    pos = list(itertools.product(*(range(s) for s in spatial)))
    emb = torch.zeros(k, len(pos), len(pos), dtype=kernel.dtype)
    for ni, p in enumerate(pos):
        for mi, q in enumerate(pos):
            t = tuple(qa - pa + c for pa, qa, c in zip(p, q, center))
            if all(0 <= ta < ks for ta, ks in zip(t, kernel.shape[3:])):
                emb[:, ni, mi] = kernel[(0, slice(None), 0, *t)]
    return emb


@pytest.mark.parametrize("ksize,center,spatial", [((7,), (3,), (6,)), ((5, 3), (2, 1), (4, 3)),
                                                  ((9, 7), (4, 3), (3, 4)), ((3, 3, 5), (1, 1, 2), (3, 2, 3))])
def test_gather_relative_embeddings_rows_match_definition(ksize, center, spatial):
    """Any chunk of query rows (first spatial axis) equals those rows of the whole E, incl. cropped kernels."""
    kernel = torch.randn(1, 3, 1, *ksize, dtype=torch.float64)
    want = naive_relative_embeddings(kernel, center, spatial)  # k n m
    row = want.shape[1] // spatial[0]
    for start, stop in [(0, spatial[0]), (0, 1), (1, spatial[0]), (spatial[0] - 1, spatial[0])]:
        got = LF.gather_relative_embeddings(kernel, center, spatial, rows=(start, stop))[0, :, 0]  # k nc m
        torch.testing.assert_close(got, want[:, start * row:stop * row])


@pytest.mark.parametrize("rows", [None, 1, 2])
@pytest.mark.parametrize("ksize,center,spatial", [((11,), (5,), (6,)), ((7, 5), (3, 2), (4, 3)),
                                                  ((3, 3, 3), (1, 1, 1), (3, 2, 2))])
def test_relative_position_output_qe_equals_whole_embeddings(ksize, center, spatial, rows):
    """E rows rebuilt per chunk from R (checkpointed) == (q E) V with the whole E, values and gradients."""
    b, h, k, v = 2, 3, 4, 5
    n = math.prod(spatial)
    q = torch.randn(b, n, h, k, dtype=torch.float64, requires_grad=True)
    kernel = torch.randn(1, k, 1, *ksize, dtype=torch.float64, requires_grad=True)
    vals = torch.randn(b, n, v, dtype=torch.float64, requires_grad=True)
    budget = None if rows is None else rows * (n // spatial[0]) * b * h * n
    out = LF.relative_position_output_qe(q, kernel, center, spatial, vals, max_chunk_elements=budget)
    emb = naive_relative_embeddings(kernel, center, spatial)  # k n m, differentiable in the kernel
    ref = torch.einsum("bnhk,knm,bmv->bhnv", q, emb, vals)
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, kernel, vals), g)
    ref_grads = torch.autograd.grad(ref, (q, kernel, vals), g)
    for name, a, r in zip("q kernel values".split(), grads, ref_grads):
        torch.testing.assert_close(a, r, msg=name)
