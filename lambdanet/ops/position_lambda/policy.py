"""The constants of ``LambdaLayer(impl="auto")``'s static cost model, one :class:`ImplPolicy` per device type
(:meth:`LambdaLayer.choose_impl`); the measuring tuner on top of it is :mod:`lambdanet.ops.position_lambda.tuning`,
the plan it dispatches to :mod:`lambdanet.ops.position_lambda.dispatch`."""

from __future__ import annotations

from dataclasses import dataclass

from lambdanet.helpers import check_positive_int

__all__ = ["ImplPolicy", "DEFAULT_IMPL_POLICY", "CUDA_IMPL_POLICY", "impl_policy", "set_impl_policy"]


@dataclass(frozen=True)
class ImplPolicy:
    """The tuning constants of the static ``impl="auto"`` cost model (:meth:`LambdaLayer.choose_impl`).

    Args:
        max_whole_positions: the most positions ``n`` for which the whole ``E[n, m]`` may be materialised
            (App. E.1: "convolution implementation only for input length |n| > 852").
        max_whole_elements: the most elements of a materialised ``E`` (``1 << 24``: 64 MiB of fp32 embeddings
            per layer).
        gemm_speedup: how much faster per multiply-add the whole-``E`` GEMMs run than the lambda convolution:
            ``einsum_qe`` is taken while its multiply-adds stay below ``gemm_speedup`` times the convolution's.
            2.5 is a CPU measurement (BENCHMARKS.md, section 1); with ``E`` built chunk by chunk the factor is 1.
        einsum_positions_per_tap: the lambdas-first ``einsum`` serves maps of at most this many positions per
            kernel tap (small maps that their scope covers), when ``E`` may be materialised.
        dense_conv_taps: the scopes (``(fewest, most)`` kernel taps after cropping to the map) whose lambda
            convolution runs as the batch-folded dense ``"conv"`` (``v`` in the batch, one input channel, ``k``
            output channels) rather than the depthwise one; both do ``taps k v`` multiply-adds per position.
            On the CPU of BENCHMARKS.md (section 1) the dense form trained 1.2-1.9x faster from 15x15 to 31x31
            scopes and 1.1x at 47x47, the depthwise one was as fast at 13x13 and faster below, and the dense
            backward collapsed at 111x111 (12x slower). The measuring tuner does not try the dense form beyond
            ``most`` taps either.
        dense_conv_speedup: the cost model divides the dense convolution's multiply-adds by this inside
            ``dense_conv_taps`` (its speed-up over the depthwise one and the row-chunked ``einsum_qe``: 1.5 on
            that CPU, training).
        qe_chunk_fraction: ``einsum_qe`` forms ``q . E`` in query chunks of at most this fraction of the
            position lambdas' ``b n k v`` elements (0.25 keeps its transient memory at half of ``lambda^p``);
            larger chunks mean fewer, larger GEMMs (kernel launches dominate small maps on a GPU).
        causal_op_positions: a causal layer with softmax keys, one group and a relative table runs its masked
            lambda in :func:`lambdanet.ops.causal_lambda` (chunked, linear in ``n``, no per-query lambda stored;
            the fused kernels on CUDA) from this many positions on, below it the per-query lambdas of the layer's
            own steps. On the CPU of BENCHMARKS.md the two trained about as fast at 64 and 1,024 positions and the
            op 1.3x slower at 256 (one contended measurement, 1 thread): 1024 keeps the per-query form below;
            on CUDA the kernels (0: always).

    The defaults are the CPU's; :data:`CUDA_IMPL_POLICY` is the one measured on an H100 (registered for
    ``"cuda"``). Other device types use the defaults until :func:`set_impl_policy` registers a policy for them.
    """

    max_whole_positions: int = 852
    max_whole_elements: int = 1 << 24
    gemm_speedup: float = 2.5
    einsum_positions_per_tap: float = 2.0
    dense_conv_taps: tuple[int, int] = (196, 2304)
    dense_conv_speedup: float = 1.5
    qe_chunk_fraction: float = 0.25
    causal_op_positions: int = 1024

    def __post_init__(self):
        check_positive_int(self.max_whole_positions, "max_whole_positions")
        n = self.causal_op_positions
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"causal_op_positions must be a non-negative int, got {n!r}")
        check_positive_int(self.max_whole_elements, "max_whole_elements")
        for name, positive in (
            ("gemm_speedup", False),
            ("einsum_positions_per_tap", False),
            ("dense_conv_speedup", True),
            ("qe_chunk_fraction", True),
        ):  # the cost model divides by dense_conv_speedup
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not (value > 0 if positive else value >= 0)
            ):
                raise ValueError(f"{name} must be a {'positive' if positive else 'non-negative'} number, got {value!r}")
        taps = self.dense_conv_taps
        if (
            not isinstance(taps, (tuple, list))
            or len(taps) != 2
            or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in taps)
            or taps[0] > taps[1]
        ):
            raise ValueError(
                f"dense_conv_taps must be (fewest, most) non-negative int taps with fewest <= most, got {taps!r}"
            )


DEFAULT_IMPL_POLICY = ImplPolicy()
# fitted to `lambdanet bench impls --device cuda` on an H100 (BENCHMARKS.md, section 8): the dense lambda
# convolution wins only at small scopes (7x7: 1.1-1.4x ahead of einsum_qe at 28x28, 2.4-20x behind at 23x23 and
# global), einsum_qe everywhere else (within 1.05x of the fastest at batch 256; at batch 64 on 14x14 maps, where
# launches dominate, einsum is 1.4x ahead); the depthwise convolution never wins
CUDA_IMPL_POLICY = ImplPolicy(dense_conv_taps=(1, 100), qe_chunk_fraction=1.0, causal_op_positions=0)
_IMPL_POLICIES: dict[str, ImplPolicy] = {"cuda": CUDA_IMPL_POLICY}  # device type -> policy measured there


def impl_policy(device_type: str) -> ImplPolicy:
    """The :class:`ImplPolicy` that ``impl="auto"`` follows on ``device_type`` (``"cpu"``, ``"cuda"``, ...)."""
    return _IMPL_POLICIES.get(device_type, DEFAULT_IMPL_POLICY)


def set_impl_policy(device_type: str, policy: ImplPolicy | None) -> ImplPolicy | None:
    """Register the policy measured on ``device_type`` (``None``: back to :data:`DEFAULT_IMPL_POLICY`).

    Returns the policy registered before (``None`` if there was none), so a caller can restore it.
    """
    if not isinstance(device_type, str) or not device_type:
        raise ValueError(f"device_type must be a device type string such as 'cpu' or 'cuda', got {device_type!r}")
    if policy is not None and not isinstance(policy, ImplPolicy):
        raise ValueError(f"policy must be an ImplPolicy or None, got {type(policy).__name__}")
    previous = _IMPL_POLICIES.pop(device_type, None)
    if policy is not None:
        _IMPL_POLICIES[device_type] = policy
    return previous
