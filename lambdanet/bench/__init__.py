"""Benchmarks: time, memory and FLOPs of layers and models, side by side with the peers."""

from lambdanet.bench.measure import PeakMemory, Timing, count_flops, peak_memory, time_fn

__all__ = ["PeakMemory", "Timing", "count_flops", "peak_memory", "time_fn"]
