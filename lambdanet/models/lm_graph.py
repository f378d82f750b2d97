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

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["StepGraph"]


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
        if capture and self.tokens.device.type != "cuda":
            raise ValueError(f"cuda_graph=True needs the model and tokens on a CUDA device, got {self.tokens.device}")
        self._fit(name)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: Tensor | None = None
        if capture:
            self._capture()

    def _run(self) -> Tensor:
        """One step on the buffers: the new state copied over the old one in place; the logits."""
        logits, new = self.advance(self.state, self.tokens)
        old_leaves, _ = tree_flatten(self.state)
        for old, fresh in zip(old_leaves, tree_flatten(new)[0]):
            if isinstance(old, Tensor) and fresh is not old:
                if fresh.untyped_storage().data_ptr() == old.untyped_storage().data_ptr():
                    fresh = fresh.clone()  # a view into the buffer it is about to overwrite
                old.copy_(fresh)
        return logits

    def _fit(self, name: str) -> None:
        """One eager step to check that the state keeps its structure and shapes (else a one-line error), and
        to take on its dtypes (a prompt's state may differ from a step's: the buffers take the step's)."""
        for _ in range(2):  # a dtype change takes one more step to settle
            with torch.no_grad():
                _, new = self.advance(self.state, self.tokens)
            old_leaves, old_spec = tree_flatten(self.state)
            new_leaves, new_spec = tree_flatten(new)
            shapes = [tuple(t.shape) if isinstance(t, Tensor) else t for t in old_leaves]
            new_shapes = [tuple(t.shape) if isinstance(t, Tensor) else t for t in new_leaves]
            if old_spec != new_spec or shapes != new_shapes:
                raise ValueError(
                    f"cuda_graph=True needs a state that keeps its size from token to token (the lambda and linear "
                    f"families); {name}'s grows (a KV cache): generate without cuda_graph"
                )
            if all(not isinstance(o, Tensor) or o.dtype == n.dtype for o, n in zip(old_leaves, new_leaves)):
                return
            self.state = tree_map(
                lambda o, n: o.to(n.dtype) if isinstance(o, Tensor) else o, self.state, new
            )  # the step's dtypes

    def _capture(self) -> None:
        """Warm up on a side stream (Triton compiles, cuBLAS picks its kernels), then capture one step. Under
        autocast the casts are captured without autocast's weight cache (its tensors would be freed when the
        autocast region that filled it ends, under the graph's feet)."""
        autocast = torch.is_autocast_enabled("cuda")
        dtype = torch.get_autocast_dtype("cuda") if autocast else torch.float16
        side = torch.cuda.Stream()
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
