"""The intra-chunk content weights of the causal lambda kernels (:mod:`lambdanet.ops.causal_lambda.triton_chunk`):
the prefix softmax of the keys, ``exp(K[m, k] - cm[n, k]) / Z[n, k]`` for query ``n`` and key ``m <= n`` of a chunk
(``cm[n]``: the running maximum at query ``n``).

Two forms, chosen per chunk inside the kernels:

* :func:`_chunk_keys`: one reference per channel for the whole chunk (its largest key), so that the weights factor
  into ``Eh[m] / Za[n]`` and the content terms are products over the chunk (FlashAttention's rescaling, per
  channel). Exact in float32 while no query's running maximum lies more than ``SAFE`` below the reference
  (``lambdanet.functional.causal.MAX_SPREAD`` = 30, the PyTorch chunk form's own limit for the same factoring).
* :func:`_weights` and the ``*_exact`` loops: channel by channel, each query against its own running maximum;
  exact for keys of any range (a key that rises by more than ``SAFE`` inside one chunk).
"""

from __future__ import annotations

import triton
import triton.language as tl

NEG_INF = tl.constexpr(float("-inf"))


@triton.jit
def _weights(keys, cb, zb, kk, b, u, base, i, n, cols, K: tl.constexpr, U: tl.constexpr, C: tl.constexpr):
    """Channel ``kk`` of the intra-chunk content weights in position space (no head: every head shares them):
    ``E[n, m] = exp(K[m] - cm[n])`` for ``m <= n`` (else 0) ``[C, C]``, ``delta[n] = exp(c_i - cm[n])`` and
    ``Z[n] >= 1`` ``[C]``, and the chunk's keys ``[C]``, all float32; ``cm[n]`` the running maximum at query ``n``."""
    m = i * C + cols
    kcol = tl.load(keys + ((b * n + m) * K + kk) * U + u, mask=m < n, other=NEG_INF).to(tl.float32)  # C
    c_i = tl.load(cb + base * K + kk)  # the running maximum before the chunk
    z_i = tl.load(zb + base * K + kk)
    causal = (cols[None, :] <= cols[:, None]) & (m < n)[None, :]  # C C (n, m)
    km = tl.where(causal, kcol[None, :], NEG_INF)  # C C
    cm = tl.maximum(tl.max(km, axis=1), c_i)  # C
    E = tl.exp(km - cm[:, None])  # C C, <= 1
    delta = tl.exp(c_i - cm)  # C, <= 1
    return E, delta, delta * z_i + tl.sum(E, axis=1), kcol


@triton.jit
def _chunk_keys(keys, cb, zb, b, u, base, i, n, cols, ks, kok, K: tl.constexpr, U: tl.constexpr, C: tl.constexpr):
    """The chunk's content weights against one reference per channel, ``a[k]``: the largest of the chunk's keys and
    the running maximum before it, so every exponent is ``<= 0``. Returns ``Eh[m, k] = exp(K[m, k] - a[k])``,
    ``Za[n, k] = dl[k] z_i[k] + sum_{m <= n} Eh[m, k]`` (``dl = exp(c_i - a)``), ``Zc = exp(cm - a)`` (``cm``: each
    query's own running maximum), all ``[C, KP]``, ``dl`` and ``spread``: how far the lowest ``cm`` lies below ``a``.

    Each query's weight ``exp(K[m] - cm[n]) / Z[n]`` is ``Eh[m] / Za[n]`` and ``Z = Za / Zc``, so the intra-chunk
    content terms become products over the chunk instead of a loop over channels. It is exact in float32 while
    ``spread <= SAFE`` (30): ``Za >= Zc >= e^-30`` stays a normal number, ``q / Za <= e^30 |q|`` far inside the
    range, and the terms that underflow (below ``e^-87``) are at most ``e^(30 - 87)`` of the query's largest. A
    wider chunk takes the channel loop."""
    m = i * C + cols
    kt = tl.load(keys + ((b * n + m[:, None]) * K + ks[None, :]) * U + u, mask=(m < n)[:, None] & kok[None, :],
                 other=NEG_INF).to(tl.float32)  # fmt: skip
    c_i = tl.load(cb + base * K + ks, mask=kok, other=0.0)  # the running maximum before the chunk
    z_i = tl.load(zb + base * K + ks, mask=kok, other=0.0)
    a = tl.where(kok, tl.maximum(tl.max(kt, axis=0), c_i), 0.0)  # KP
    Eh = tl.exp(kt - a[None, :])  # C KP, <= 1 (0 past the sequence and in padded channels)
    dl = tl.exp(c_i - a)  # KP, <= 1
    Za = tl.where(kok[None, :], dl[None, :] * z_i[None, :] + tl.cumsum(Eh, axis=0), 1.0)  # C KP
    cm = tl.maximum(tl.associative_scan(kt, 0, _maximum), c_i[None, :])  # C KP: each query's running maximum
    Zc = tl.where(kok[None, :], tl.exp(cm - a[None, :]), 1.0)  # C KP, <= 1: Z[n] = Za[n] / Zc[n]
    spread = tl.max(tl.where(kok, a - cm.min(axis=0), NEG_INF), axis=0)  # how far below a the lowest cm lies
    return Eh, Za, Zc, dl, spread


@triton.jit
def _factored_scores(q3, Za, Eh, nr, cols, HP: tl.constexpr, C: tl.constexpr, KP: tl.constexpr):
    """The chunk's content scores from :func:`_chunk_keys`'s factors: ``A[n, m] = sum_k (q~[n, k] / Za[n, k])
    Eh[m, k]`` for ``m <= n`` (else 0), one float32 product ``[h C, KP] x [KP, C]``, and its left factor
    ``q~ / Za`` ``[h C, KP]`` (``q3``: the queries ``[HP, C, KP]`` in float32; ``nr``: each row's position)."""
    Qz = tl.reshape(q3 / Za[None, :, :], [HP * C, KP])  # R KP
    A = tl.dot(Qz, tl.trans(Eh), input_precision="ieee")  # R C
    return tl.where(cols[None, :] <= nr[:, None], A, 0.0), Qz


@triton.jit
def _maximum(x, y):
    return tl.maximum(x, y)


@triton.jit
def _content_exact(q, keys, cb, zb, b, u, base, i, n, cols, ks, h3, pos3, ok3, H: tl.constexpr, HP: tl.constexpr,
                   K: tl.constexpr, U: tl.constexpr, C: tl.constexpr, KP: tl.constexpr):  # fmt: skip
    """The chunk's content scores ``A [h C, C]`` and ``delta / Z`` ``[C, KP]``, channel by channel relative to each
    query's own running maximum (:func:`_weights`): exact for keys of any range, where :func:`_chunk_keys`'s one
    reference per channel would underflow."""
    A3 = tl.zeros([HP, C, C], tl.float32)  # the chunk's content scores (head, n, m)
    DZ = tl.zeros([C, KP], tl.float32)  # delta / Z per position and channel
    for kk in range(K):  # a loop, not unrolled: compile time
        E, delta, Z, _ = _weights(keys, cb, zb, kk, b, u, base, i, n, cols, K, U, C)  # C C, C, C
        qk = tl.load(q + ((b * n + pos3) * H + h3) * K + kk, mask=ok3, other=0.0).to(tl.float32)  # HP C
        A3 += (qk / Z[None, :])[:, :, None] * E[None, :, :]
        DZ += tl.where(ks[None, :] == kk, (delta / Z)[:, None], 0.0)
    return tl.reshape(A3, [HP * C, C]), DZ


@triton.jit
def _grad_exact(keys, cb, zb, D0, b, u, base, i, n, cols, ks, kok, HP: tl.constexpr, K: tl.constexpr,
                U: tl.constexpr, C: tl.constexpr, KP: tl.constexpr):  # fmt: skip
    """:func:`_grad_local`'s content weights channel by channel (keys of any range, as :func:`_content_exact`):
    ``sum_m E[n, m] D0[n, m] / Z[n]`` ``[HP, C, KP]``, ``delta / Z`` and ``1 / Z`` ``[C, KP]``."""
    ks3 = ks[None, None, :]
    D03 = tl.reshape(D0, [HP, C, C])
    T3 = tl.zeros([HP, C, KP], tl.float32)  # sum_m E[n, m, k] dy . V[m] per head
    Zs = tl.zeros([C, KP], tl.float32)  # Z[n, k]
    Ds = tl.zeros([C, KP], tl.float32)  # delta[n, k]
    for kk in range(K):  # a loop, not unrolled: compile time
        E, delta, Z, _ = _weights(keys, cb, zb, kk, b, u, base, i, n, cols, K, U, C)  # C C, C, C
        T3 = tl.where(ks3 == kk, tl.sum(E[None, :, :] * D03, axis=2)[:, :, None], T3)
        Zs = tl.where(ks[None, :] == kk, Z[:, None], Zs)
        Ds = tl.where(ks[None, :] == kk, delta[:, None], Ds)
    Zs = tl.where(kok[None, :], Zs, 1.0)
    return T3 / Zs[None, :, :], Ds / Zs, 1.0 / Zs


@triton.jit
def _keys_exact(q, keys, cb, zb, D0, rr, b, u, base, i, n, cols, ks, h3, pos3, ok3, H: tl.constexpr,
                HP: tl.constexpr, K: tl.constexpr, U: tl.constexpr, C: tl.constexpr, KP: tl.constexpr):  # fmt: skip
    """:func:`_grad_keys_values`'s content terms channel by channel (keys of any range, as :func:`_content_exact`):
    the scores ``A [h C, C]`` and the keys' softmax gradient ``[C, KP]`` (``rr``: ``rho`` of the chunk's queries)."""
    D03 = tl.reshape(D0, [HP, C, C])
    A3 = tl.zeros([HP, C, C], tl.float32)  # the chunk's content scores (head, n, m)
    dks = tl.zeros([C, KP], tl.float32)
    for kk in range(K):  # a loop, not unrolled: compile time
        E, _, Z, _ = _weights(keys, cb, zb, kk, b, u, base, i, n, cols, K, U, C)  # C C, C
        qk = tl.load(q + ((b * n + pos3) * H + h3) * K + kk, mask=ok3, other=0.0).to(tl.float32)  # HP C
        rk = tl.sum(tl.where(ks[None, :] == kk, rr, 0.0), axis=1)  # C: rho[n], every head's
        Aq = (qk / Z[None, :])[:, :, None] * E[None, :, :]  # HP C C: q~[n] E[n, m]
        dk = tl.sum(tl.sum(Aq * D03, axis=0), axis=0) - tl.sum(E * rk[:, None], axis=0)  # C
        dks = tl.where(ks[None, :] == kk, dk[:, None], dks)
        A3 += Aq
    return tl.reshape(A3, [HP * C, C]), dks
