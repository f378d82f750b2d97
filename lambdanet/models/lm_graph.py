"""Generation steps replayed from a CUDA graph: what a constant-size state makes possible.

A lambda (or linear-attention) language model carries the same tensors from token to token, whatever the
context: one step is a fixed sequence of kernels on fixed buffers, so it can be captured once
(``torch.cuda.CUDAGraph``) and replayed per token, one launch for the whole model instead of a dozen per block.
A transformer's KV cache grows by a position each step (new shapes, new buffers): it cannot, and is refused.

:class:`StepGraph` keeps the static buffers: the state (copied in place at the end of each step, inside the
graph) and the token fed to the step; ``step(tokens)`` copies the tokens in, replays, and returns the logits
buffer (overwritten by the next call: sample from it before). ``capture=False`` runs the same static-buffer
step eagerly instead of replaying a graph (the CPU tests' path: everything but the capture itself).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["StepGraph", "GrowingStateError"]


class GrowingStateError(ValueError):
    """A CUDA graph asked of a model whose state grows (``what``: how), in the words of what asked (``asked``: the
    argument or the command-line flag, ``instead``: how to do without)."""

    def __init__(self, what: str, asked: str = "cuda_graph=True", instead: str = "generate without cuda_graph"):
        self.what = what
        super().__init__(f"{asked} needs a state that keeps its size from token to token (the lambda and linear "
                         f"families); {what}: {instead}")  # fmt: skip


class StepGraph:
    """One-token steps of ``advance(state, tokens [b, 1]) -> (logits [b, vocab], state)`` (a model's step
    without its host-side checks) on static buffers, captured as a CUDA graph when ``capture``.

    Args:
        advance: the step; it must read nothing on the host (no ``.item()``), keep the state's structure, shapes
            and dtypes, and run the same kernels every call.
        state: the state to continue (copied: the caller's tensors are not touched).
        tokens: ``[b]`` or ``[b, 1]``, the shape (and device) of every later call's tokens.
        capture: capture a CUDA graph (needs CUDA tensors); ``False``: run ``advance`` on the buffers eagerly.
        name: the model's name, for the error when its state grows.
    """

    devices: tuple[str, ...] = ("cuda",)  # where a graph is captured

    @classmethod
    def check_device(cls, device: torch.device) -> None:
        """A one-line error unless a graph can be captured on ``device``."""
        if device.type not in cls.devices:
            raise ValueError(f"cuda_graph=True needs the model and tokens on a CUDA device, got {device}")

    def __init__(
        self,
        advance: Callable[[dict, Tensor], tuple[Tensor, dict]],
        state: dict,
        tokens: Tensor,
        *,
        capture: bool = True,
        name: str = "the model",
    ):
        self.advance, self.capture = advance, capture
        self.tokens = tokens.reshape(-1, 1).clone()  # b 1
        self.state = tree_map(lambda t: t.clone() if isinstance(t, Tensor) else t, state)
        if capture:
            self.check_device(self.tokens.device)
        self._fit(name)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: Tensor | None = None
        if capture:
            self._capture()

    def _run(self) -> Tensor:
        """One step on the buffers: the new state copied over the old one in place; the logits."""
        logits, new = self.advance(self.state, self.tokens)
        old_leaves = tree_flatten(self.state)[0]
        new_leaves = tree_flatten(_aligned(self.state, new))[0]
        buffers = {t.untyped_storage().data_ptr() for t in old_leaves if isinstance(t, Tensor)}
        fresh = [
            n.clone() if isinstance(n, Tensor) and n is not o and n.untyped_storage().data_ptr() in buffers else n
            for o, n in zip(old_leaves, new_leaves)
        ]  # a view into a buffer that the copies below may overwrite first: taken apart before any copy
        for old, value in zip(old_leaves, fresh):
            if isinstance(old, Tensor) and value is not old:
                old.copy_(value)
        return logits

    def _fit(self, name: str) -> None:
        """Eager steps to check that the state keeps its structure and shapes (else a one-line error), and to
        take on its dtypes (a prompt's state may differ from a step's: the buffers take the step's)."""
        for _ in range(2):  # a dtype change takes one more step to settle
            with torch.no_grad():
                _, new = self.advance(self.state, self.tokens)
            new = _aligned(self.state, new, name)
            old_leaves, new_leaves = tree_flatten(self.state)[0], tree_flatten(new)[0]
            if all(not isinstance(o, Tensor) or o.dtype == n.dtype for o, n in zip(old_leaves, new_leaves)):
                return
            self.state = tree_map(lambda o, n: o.to(n.dtype) if isinstance(o, Tensor) else o, self.state, new)
        pairs = [(o, n) for o, n in zip(old_leaves, new_leaves) if isinstance(o, Tensor)]
        changing = sorted({f"{o.dtype} -> {n.dtype}" for o, n in pairs if o.dtype != n.dtype})
        raise ValueError(f"cuda_graph=True needs a state whose dtypes settle; {name}'s keep changing ({changing})")

    def _capture(self) -> None:
        """Warm up on a side stream (Triton compiles, cuBLAS picks its kernels), then capture one step. Under
        autocast the casts are captured without autocast's weight cache (its tensors would be freed when the
        autocast region that filled it ends, under the graph's feet)."""
        autocast = torch.is_autocast_enabled("cuda")
        dtype = torch.get_autocast_dtype("cuda") if autocast else torch.float16
        device = self.tokens.device
        with torch.cuda.device(device):  # the tokens' GPU, whichever is current
            self._capture_on(torch.cuda.Stream(device), autocast, dtype)

    def _capture_on(self, side: torch.cuda.Stream, autocast: bool, dtype: torch.dtype) -> None:
        side.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.autocast("cuda", dtype=dtype, enabled=autocast, cache_enabled=False):
            with torch.cuda.stream(side):
                for _ in range(2):
                    self.advance(self.state, self.tokens)  # the buffers unchanged: only _run copies back
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.logits = self._run()

    @torch.no_grad()
    def step(self, tokens: Tensor) -> Tensor:
        """Feed ``tokens [b]`` (or ``[b, 1]``): the logits ``[b, vocab]`` after them (a buffer the next call
        overwrites); the state moves one position on."""
        self.tokens.copy_(tokens.reshape(-1, 1))
        if self.graph is None:
            return self._run()
        self.graph.replay()
        return self.logits  # type: ignore[return-value]


def _aligned(old, new, name: str = "the model"):
    """``new`` laid out as ``old`` (dict keys in ``old``'s order, which a step need not keep), after checking
    that it has the same keys, lengths and tensor shapes, and the same values where a leaf is not a tensor."""

    def fail(why: str) -> NoReturn:
        raise GrowingStateError(f"{name}'s {why}")

    if isinstance(old, dict):
        if not isinstance(new, dict) or set(old) != set(new):
            fail("changes its entries")
        return {key: _aligned(old[key], new[key], name) for key in old}
    if isinstance(old, (list, tuple)):
        if not isinstance(new, (list, tuple)) or len(old) != len(new):
            fail("changes its entries")
        return type(old)(_aligned(o, n, name) for o, n in zip(old, new))
    if isinstance(old, Tensor):
        if not isinstance(new, Tensor) or new.shape != old.shape:
            fail("grows (a KV cache)")
        return new
    if old != new:
        fail(f"holds a Python value that changes ({old!r} -> {new!r})")
    return new
