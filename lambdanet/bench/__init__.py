"""Benchmarks: time, memory and FLOPs of layers and models, side by side with the peers.

``layer_bench`` measures spatial layers (``timing`` times them), ``model_bench`` whole models and Table 4's memory
column, ``peers`` builds the other projects' layers, ``runner`` runs the parts of ``lambdanet bench`` (``part`` says
what a part is, ``layer_parts`` holds the layer parts) and ``report`` writes their files. The measurement
primitives live in :mod:`lambdanet.runtime` and are re-exported here.
"""

from lambdanet.runtime import PeakMemory, Timing, count_flops, peak_memory, time_fn

__all__ = ["PeakMemory", "Timing", "count_flops", "peak_memory", "time_fn"]
