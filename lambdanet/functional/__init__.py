"""Functional core of the lambda layer, written to be read next to the paper's figures.

Symbols (LambdaNetworks, Bello 2021): ``b`` batch, ``n`` queries (input positions), ``m`` context
positions, ``k`` query/key depth, ``v`` value depth, ``h`` heads (queries per lambda), ``u`` intra-depth,
``r`` local scope size, ``d = h * v`` output dimension, ``g`` lambda groups (1 for the multi-query
layer, ``h`` for the multi-head layer of Fig. 7).

Two families live here, one module each (both importable from ``lambdanet.functional``; the fast one is the
position-lambda op's, :mod:`lambdanet.ops.position_lambda`, where the layer's implementations, kernels and
dispatch live):

* :mod:`~lambdanet.functional.reference`: the readable reference path, paper-shaped functions with the
  figures' argument order and shapes, plain einsums exactly as printed: :func:`lambda_layer` (Fig. 3, with
  the optional intra-depth of Fig. 8), :func:`compute_position_lambdas` (Fig. 5), :func:`masked_lambda_layer`
  (Fig. 6) and :func:`multihead_lambda_layer` (Fig. 7).
* :mod:`~lambdanet.ops.position_lambda.fast` (formerly ``lambdanet.functional.fast``): the N-d building blocks of
  :class:`lambdanet.layers.LambdaLayer` (the fast path): relative embeddings as a kernel ``R[g, k, u, *K]``
  re-indexed into ``E[g, k, u, n, m]`` (paper Sec. 3.3), position lambdas through the lambda convolution (three
  interchangeable implementations, App. B.1), content lambdas (global or causal through cumulative sums, App. B.2;
  in :mod:`~lambdanet.functional.content`, re-exported by ``fast``) and the application of lambdas to queries as
  GEMMs.

Layouts of the intra-depth axis ``u`` (Fig. 8 orders it ``[k, n, m, u]`` / ``[r, 1, u, k]``):

* Paper-shaped functions: ``u`` last (``keys [b, m, k, u]``, ``values [b, m, v, u]``,
  ``embeddings [n, m, k, u]``).
* Relative kernels and embeddings: ``u`` after ``k``, the spatial axes last, as a convolution weight
  (``R [g, k, u, *K]``, ``E [g, k, u, n, m]``); values for the lambda convolution ``[b, g, v, u, *S]``.
* Content lambdas: ``u`` last (``keys [b, m, g, k, u]``, ``values [b, m, g, v, u]``); value tokens
  ``[b, n, (g v u)]``.
* Lambdas carry no ``u`` (it is summed): ``[b, g, v, k, *S]`` from the convolutions, ``[b, n, g, v, k]``
  per position for :func:`apply_lambdas`.

Where the paper disagrees with itself the choice is written down: Fig. 7 prints the multi-head position
output as ``'bhnk,bnkv->bnhv'``; the position lambdas it builds are ``bnhkv`` (one per head), so the
contraction must be ``'bhnk,bnhkv->bnhv'``.

Speed measurements of these implementations are in BENCHMARKS.md, not here.
"""

from lambdanet.functional.reference import *  # noqa: F403
from lambdanet.functional.reference import __all__ as _reference
from lambdanet.ops.position_lambda.fast import *  # noqa: F403
from lambdanet.ops.position_lambda.fast import __all__ as _fast

__all__ = [*_reference, *_fast]
