"""Code paths that run only on CUDA machines, checked on the CPU: torch's CUDA and NCCL entry points are replaced by
stand-ins that record what they are given (the device, the timeout), or that behave as a machine with GPUs does
(``torch.cuda.set_rng_state``'s own code runs, on stand-in generators). tests/test_device.py runs the rest on a GPU."""

from __future__ import annotations

import contextlib
import datetime
import random
import types

import pytest
import torch
import torch.distributed as dist

from lambdanet.engine.checkpoint import set_rng_state
from lambdanet.engine.distributed import DistContext, barrier, cleanup, init_distributed


class _Generator:
    """A CUDA generator stand-in: the state it was last given."""

    def __init__(self):
        self.state = None

    def set_state(self, state):
        self.state = state.clone()


def _gpus(monkeypatch, count: int) -> list[_Generator]:
    """This process as one on a machine with ``count`` GPUs and CUDA initialised: torch.cuda.set_rng_state runs its
    callback at once, on these generators (a real machine's ``torch.cuda.default_generators``)."""
    generators = [_Generator() for _ in range(count)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "default_generators", tuple(generators))
    monkeypatch.setattr(torch.cuda.random, "_lazy_call", lambda callback, **_: callback())
    return generators


@pytest.mark.parametrize("gpus", [1, 2, 3])
def test_generators_saved_on_two_gpus_restore_on_the_gpus_a_machine_has(monkeypatch, gpus):
    """A checkpoint holds one CUDA generator state per GPU its process saw (``torch.cuda.get_rng_state_all``): one
    from a 2-GPU machine resumed on a 1-GPU machine raised an IndexError (torch's ``set_rng_state_all`` sets every
    index it is given), and the run could not resume. Each GPU gets its own index's state; GPUs the saving machine
    did not have keep theirs."""
    saved = [torch.full((16,), i + 1, dtype=torch.uint8) for i in range(2)]  # states told apart by their bytes
    state = {"python": random.getstate(), "torch": torch.get_rng_state(), "cuda": saved}
    generators = _gpus(monkeypatch, gpus)
    set_rng_state(state)
    for i, generator in enumerate(generators):
        if i < len(saved):
            assert torch.equal(generator.state, saved[i]), i
        else:
            assert generator.state is None, i


def _group_env(monkeypatch, rank: int, calls: list) -> None:
    """torchrun's variables for ``rank`` of 2, and the process-group calls recorded instead of made."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("LOCAL_RANK", str(rank))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append(("init", backend, kw)))
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.append(("set_device", index)))


def test_an_nccl_group_waits_as_long_as_a_gloo_group(monkeypatch):
    """The other processes wait in a collective while the main one alone evaluates (detect's COCO AP) or writes the
    outputs. NCCL's default timeout is 10 minutes, gloo's (which the tests run) 30: a main-only evaluation between
    the two passed on CPUs and had NCCL's watchdog end the GPU group before the epoch was saved. Both backends now
    get gloo's default timeout."""
    calls: list = []
    _group_env(monkeypatch, 1, calls)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    ctx = init_distributed("cuda")
    assert calls[0] == ("set_device", 1) and ctx.device == torch.device("cuda", 1)  # LOCAL_RANK's GPU, then NCCL
    _, backend, nccl = calls[1]
    assert backend == "nccl" and (nccl["rank"], nccl["world_size"]) == (1, 2)
    calls.clear()
    init_distributed("cpu")
    [(_, backend, gloo)] = calls
    assert backend == "gloo"
    assert nccl["timeout"] == gloo["timeout"] == datetime.timedelta(minutes=30)  # torch's gloo default


def test_a_barrier_names_the_processs_gpu_under_nccl(monkeypatch):
    """``dist.barrier`` without ``device_ids`` takes the current GPU and warns on rank 0; the engine's barriers (and
    the one before leaving the group) name the process's own GPU, and none on the CPU (gloo)."""
    calls: list = []
    monkeypatch.setattr(dist, "barrier", lambda **kw: calls.append(("barrier", kw.get("device_ids"))))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: calls.append(("destroy",)))
    on_gpu = DistContext(rank=1, world=2, local_rank=1, device=torch.device("cuda", 1))
    barrier(on_gpu)
    barrier(DistContext(rank=1, world=2))
    barrier(DistContext(device=torch.device("cuda", 0)))  # one process: no barrier at all
    cleanup(on_gpu, synchronize=True)
    assert calls == [("barrier", [1]), ("barrier", None), ("barrier", [1]), ("destroy",)]


def test_the_tuners_timing_waits_for_the_gpu_its_tensors_are_on(monkeypatch):
    """``bench causal_tune``'s timer recorded its CUDA events on the current GPU's stream and waited for that GPU:
    inputs on another GPU were timed as nothing. Every synchronisation and event of the timing is now on the
    device given."""
    from lambdanet.bench import causal_tune as CT

    devices: list = []

    class Event:
        def __init__(self, enable_timing=False):
            self.at = None

        def record(self, stream=None):
            devices.append(("record", stream.device))
            self.at = len(devices)

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return float(end.at - self.at)  # ms: the records between the two events

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: devices.append(("sync", device)))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(device=device))
    calls = []
    ms = CT.cuda_median_ms(lambda: calls.append(1), warmup=2, reps=3, device="cuda:1")
    assert len(calls) == 2 + 3 and ms == 1.0
    assert devices and all(device == torch.device("cuda", 1) for _, device in devices)


def test_no_implementation_is_timed_while_a_cuda_graph_is_captured(monkeypatch):
    """A ``LambdaLayer(impl="auto")`` call with no measured winner times its candidates, synchronising the GPU: inside
    a CUDA graph capture (one whose warm-up ran another batch size) that ended the capture with CUDA's error. The
    tuner now leaves the static choice there (and measures at the next eager call). Checked on stand-ins for the
    tensors and the capture state: a capture on cuda:1's current stream."""
    from lambdanet.ops.position_lambda import guard

    current = [0]

    @contextlib.contextmanager
    def device(d):
        previous, current[0] = current[0], torch.device(d).index
        try:
            yield
        finally:
            current[0] = previous

    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: current[0] == 1)
    on = [types.SimpleNamespace(device=torch.device("cuda", i)) for i in range(2)]
    assert guard._capturing(on[1]) and guard._capturing(on[0], on[1])
    assert not guard._capturing(on[0]) and current[0] == 0  # the current GPU as it was
    assert not guard._capturing(torch.zeros(2))  # CPU tensors: no CUDA call
