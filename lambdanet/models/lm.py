"""Decoder-only language models: the causal lambda LM and its two same-size baselines.

Every model is ``embedding -> depth x [norm -> mixer -> residual, norm -> MLP -> residual] -> norm -> logits``
with the output layer tied to the embedding, a byte vocabulary (256) by default, and differs only in its
token mixer:

* ``lambda_lm_<size>``: :class:`~lambdanet.layers.CausalLambdaLayer` (content lambda over the whole prefix,
  position lambdas over the last ``r`` tokens; no other position signal);
* ``transformer_lm_<size>``: :class:`~lambdanet.layers.CausalSelfAttention` (rotary positions, or learnt ones
  with ``positions="learned"`` and a ``max_len``);
* ``linear_lm_<size>``: the lambda layer without position lambdas (``r = 0``): causal linear attention with
  softmax-normalised keys, which shows what the position lambdas add.

The lambda layer's value depth is chosen so that its parameters match multi-head attention's ``4 d^2``
(:func:`matched_dim_v`): the three families of one size have the same width, depth and MLP, and parameter
counts within 2%. The registered names are in :mod:`lambdanet.models.lm_zoo`.

Interface: ``model(tokens [b, n])`` -> logits ``[b, n, vocab]``; ``state = model.init_state(b)``,
``logits, state = model.step(state, tokens [b])``; ``model.generate(tokens, max_new_tokens, temperature,
top_k, generator)``. States are plain dicts of tensors: the lambda models' size is fixed, the transformer's
KV cache grows with the context.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lambdanet.helpers import check_choice, check_int, check_positive_int, is_finite_real, plain_real
from lambdanet.layers.causal_attention import CausalSelfAttention, step_arguments
from lambdanet.layers.causal_lambda import CausalLambdaLayer
from lambdanet.models.lm_graph import GrowingStateError, StepGraph

__all__ = ["LanguageModel", "LMSize", "LM_SIZES", "MIXERS", "matched_dim_v", "sample_next", "ContextTooLongError"]

MIXERS = ("lambda", "transformer", "linear", "hybrid")
POSITIONS = ("rotary", "learned")


@dataclass(frozen=True)
class LMSize:
    """One size of the language-model families (shared by the three mixers).

    Attributes:
        dim: model width ``d``.
        depth: blocks.
        heads: query heads (the transformer's attention heads, the lambda layer's ``|h|``).
        dim_k: the lambda layer's query/key depth ``|k|``.
        r: the lambda layer's causal local scope (the linear mixer has none: it ignores ``r``).
        mlp_ratio: MLP hidden width / ``d``.
    """

    dim: int
    depth: int
    heads: int
    dim_k: int = 16
    r: int = 64
    mlp_ratio: float = 4.0


LM_SIZES = {
    "nano": LMSize(dim=64, depth=2, heads=2, r=16),  # for tests
    "tiny": LMSize(dim=128, depth=4, heads=4),
    "small": LMSize(dim=256, depth=6, heads=4),
    "base": LMSize(dim=512, depth=8, heads=8),
}


def matched_dim_v(dim: int, heads: int, dim_k: int) -> int:
    """The lambda layer's value depth ``|v|`` (a multiple of 8) whose parameters ``d (h k + k + v + h v)``
    come closest to multi-head attention's ``4 d^2``."""
    return max(8, round((4 * dim - (heads + 1) * dim_k) / (heads + 1) / 8) * 8)


class _Block(nn.Module):
    def __init__(self, mixer: CausalSelfAttention | CausalLambdaLayer, dim: int, mlp_ratio: float, dropout: float):
        super().__init__()
        hidden = int(dim * mlp_ratio)
        self.norm1, self.mixer, self.norm2 = nn.LayerNorm(dim), mixer, nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor, state: dict | None, return_state: bool = True) -> tuple[Tensor, dict | None]:
        """``x [b, n, d]`` after the mixer's ``state`` -> (``[b, n, d]``, the mixer's state after ``x``, or ``None``
        without ``return_state``: a training step's mixers then make none)."""
        res = self.mixer(self.norm1(x), state, return_state=return_state)  # b n d
        y, state = res if return_state else (res, None)
        x = x + self.drop(y)
        return x + self.drop(self.mlp(self.norm2(x))), state  # b n d

    def step(self, state: dict, x: Tensor) -> tuple[Tensor, dict]:
        """One position, ``x [b, d]`` after the mixer's ``state``, with the mixer's streaming step (the earlier
        order ``step(x, state)`` still works for one release, with a warning)."""
        state, x = step_arguments(state, x, f"{type(self).__name__}.step")
        y, state = self.mixer.step(state, self.norm1(x))  # b d
        x = x + self.drop(y)
        return x + self.drop(self.mlp(self.norm2(x))), state  # b d


class LanguageModel(nn.Module):
    """A decoder-only language model (see the module docstring).

    Args:
        mixer: ``"lambda"``, ``"transformer"``, ``"linear"`` or ``"hybrid"`` (lambda blocks with causal attention
            in every ``attention_every``-th block).
        dim: model width ``d`` (:class:`LMSize`, as the next five).
        depth: blocks.
        heads: query heads.
        dim_k: the lambda layer's query/key depth ``|k|``.
        r: the lambda layer's causal local scope (the linear mixer has none: it ignores ``r``).
        mlp_ratio: MLP hidden width / ``d``.
        vocab_size: tokens (256: bytes).
        dim_v: the lambda layer's value depth (default :func:`matched_dim_v`); ignored by the transformer.
        dim_u: the lambda layer's intra-depth ``|u|``.
        chunk: the lambda layer's chunk length in training.
        positions: the transformer's position signal, ``"rotary"`` or ``"learned"`` (needs ``max_len``).
        max_len: the longest sequence a model with learnt positions takes (only with them: the others take any).
        dropout: dropout on the residual branches.
        decay: the lambda layers' content decay (:class:`~lambdanet.layers.causal_lambda.CausalLambdaLayer`:
            ``None``, ``"fixed"`` or ``"gate"``).
        short_conv: the lambda layers' short causal convolution width (0: none).
        attention_every: the hybrid model's attention blocks: the ``attention_every``-th, ``2 attention_every``-th,
            ... (the last of each group).
        lambdas: the lambda layers' number of lambdas (1: multi-query; ``heads``: one per head).
        content: the lambda layers' content lambdas (``False``: position lambdas alone).
        key_norm: the lambda layers' key normalisation over the prefix, ``"softmax"``, ``"l2"`` or ``"none"``.
        query_softmax: the lambda layers' queries softmax-normalised over ``k`` too.
    """

    def __init__(
        self,
        mixer: str,
        dim: int,
        depth: int,
        heads: int,
        *,
        vocab_size: int = 256,
        dim_k: int = 16,
        r: int = 64,
        mlp_ratio: float = 4.0,
        dim_v: int | None = None,
        dim_u: int = 1,
        chunk: int = 64,
        positions: str = "rotary",
        max_len: int | None = None,
        dropout: float = 0.0,
        decay: str | None = None,
        short_conv: int = 0,
        attention_every: int = 4,
        lambdas: int = 1,
        content: bool = True,
        key_norm: str = "softmax",
        query_softmax: bool = False,
    ):
        super().__init__()
        check_choice(mixer, "mixer", MIXERS)
        check_choice(positions, "positions", POSITIONS)
        for value, name in ((vocab_size, "vocab_size"), (dim, "dim"), (depth, "depth"), (heads, "heads")):
            check_positive_int(value, name)
        learned = mixer == "transformer" and positions == "learned"
        if learned and max_len is None:
            raise ValueError("positions='learned' needs max_len (the longest sequence the model takes)")
        if max_len is not None:
            check_positive_int(max_len, "max_len")
            if not learned:
                raise ValueError(f"max_len is for the transformer's positions='learned' (got mixer={mixer!r}, "
                                 f"positions={positions!r}, which take any length); leave max_len out")  # fmt: skip
        self.mixer, self.vocab_size, self.dim = mixer, vocab_size, dim
        self.max_len = max_len if learned else None
        self.embed = nn.Embedding(vocab_size, dim)
        self.pos_embed = nn.Parameter(torch.zeros(cast(int, max_len), dim)) if learned else None  # checked above
        if mixer != "transformer":
            dim_v = matched_dim_v(dim, heads, dim_k) if dim_v is None else dim_v
        check_positive_int(attention_every, "attention_every")
        if not (is_finite_real(plain_real(mlp_ratio)) and int(dim * plain_real(mlp_ratio)) >= 1):
            raise ValueError(f"mlp_ratio must be a number > 0 with dim * mlp_ratio >= 1 (the MLP's hidden width), got "
                             f"{mlp_ratio!r} at dim={dim}")  # fmt: skip
        if mixer == "hybrid" and attention_every > depth:
            raise ValueError(f"attention_every must be at most depth={depth} (every attention_every-th block "
                             f"attends), got {attention_every}: the model would have no attention block")  # fmt: skip
        if mixer == "linear" and not content:
            raise ValueError("content=False leaves the linear mixer nothing (it has no position lambdas)")
        attention = [mixer == "transformer" or (mixer == "hybrid" and (i + 1) % attention_every == 0)
                     for i in range(depth)]  # fmt: skip
        lambda_r = 0 if mixer == "linear" else r
        mixers = [
            CausalSelfAttention(dim, heads, rotary=not learned)
            if a
            else CausalLambdaLayer(
                dim,
                heads,
                dim_k,
                dim_v,
                dim_u,
                lambda_r,
                chunk,
                decay=decay,
                short_conv=short_conv,
                lambdas=lambdas,
                content=content,
                key_norm=key_norm,
                query_softmax=query_softmax,
            )  # fmt: skip
            for a in attention
        ]
        self.blocks = nn.ModuleList(_Block(m, dim, mlp_ratio, dropout) for m in mixers)
        self.norm = nn.LayerNorm(dim)
        self._init_weights(depth)

    def _init_weights(self, depth: int) -> None:
        """GPT-2's: linear and embedding weights ``N(0, 0.02)``, biases 0, the residual branches' last layers
        ``N(0, 0.02 / sqrt(2 depth))``; the lambda layers' position embeddings and options (the gate, the decay
        rates, the short convolution) keep their own."""
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(cast(Tensor, m.bias))
        for block in cast("Iterable[_Block]", self.blocks):
            for last in (block.mixer.proj, cast(nn.Linear, block.mlp[2])):
                nn.init.normal_(last.weight, std=0.02 / math.sqrt(2 * depth))
            if isinstance(block.mixer, CausalLambdaLayer):  # the gate (an nn.Linear) starts at zero weights and the
                block.mixer.reset_options()  # decay rates as its bias, not as the loop above left it (no draws)
        if self.pos_embed is not None:
            nn.init.normal_(self.pos_embed, std=0.02)

    def _check_tokens(self, tokens: Tensor, start: int = 0, length: bool = True) -> None:  # length: max_len's
        integer = isinstance(tokens, Tensor) and not tokens.dtype.is_floating_point and not tokens.dtype.is_complex
        if not integer or tokens.dim() != 2 or tokens.dtype == torch.bool:
            got = f"a {str(tokens.dtype).removeprefix('torch.')} tensor of shape {tuple(tokens.shape)}" if isinstance(
                tokens, Tensor) else type(tokens).__name__  # fmt: skip
            raise ValueError(f"tokens must be an integer tensor [batch, length], got {got}")
        # the range check reads the tokens on the host: not inside a compiled graph (no graph break)
        if (
            tokens.numel()
            and not torch.compiler.is_compiling()
            and (int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab_size)
        ):
            raise ValueError(
                f"tokens must lie in [0, vocab_size={self.vocab_size}), got values from "
                f"{int(tokens.min())} to {int(tokens.max())}"
            )
        if length and self.max_len is not None and start + tokens.shape[1] > self.max_len:
            raise ValueError(
                f"the sequence is {start + tokens.shape[1]} tokens long but the model takes at most "
                f"max_len={self.max_len} (learnt positions)"
            )

    def init_state(self, batch_size: int) -> dict:
        """The empty context: ``{"position": 0-d long tensor, "layers": [one state per block]}``."""
        check_positive_int(batch_size, "batch_size")
        device = self.embed.weight.device
        return {
            "position": torch.zeros((), dtype=torch.long, device=device),
            "layers": [b.mixer.init_state(batch_size) for b in cast("Iterable[_Block]", self.blocks)],
        }

    def forward(self, tokens: Tensor, state: dict | None = None, return_state: bool = False):
        """``tokens [b, n]`` -> logits ``[b, n, vocab_size]``; with ``state`` the tokens continue that context,
        and ``return_state`` also returns the state after them."""
        start = 0 if state is None else self._check_state(state)
        self._check_tokens(tokens, start)
        x = self.embed(_as_index(tokens))  # b n d
        if self.pos_embed is not None:
            x = x + self.pos_embed[start : start + tokens.shape[1]]  # b n d
        layers = [None] * len(self.blocks) if state is None else state["layers"]
        new = []
        for block, s in zip(self.blocks, layers):
            x, s = block(x, s, return_state)  # b n d
            new.append(s)
        logits = self.norm(x) @ self.embed.weight.t()  # b n vocab
        if not return_state:
            return logits
        position = torch.tensor(start + tokens.shape[1], dtype=torch.long, device=tokens.device)
        return logits, {"position": position, "layers": new}

    def step(self, state: dict, tokens: Tensor) -> tuple[Tensor, dict]:
        """One position: ``tokens [b]`` (or ``[b, 1]``) after the context ``state`` -> (logits ``[b, vocab]``,
        the state one position further)."""
        if not isinstance(tokens, Tensor):
            raise ValueError(f"tokens must be an integer tensor [batch] or [batch, 1], got {type(tokens).__name__}")
        tokens = tokens.reshape(-1, 1) if tokens.dim() == 1 else tokens
        if tokens.dim() != 2 or tokens.shape[1] != 1:
            raise ValueError(f"step takes one token per sequence, [batch] or [batch, 1], got {tuple(tokens.shape)}")
        self._check_tokens(tokens, self._check_state(state))
        return self._advance(state, _as_index(tokens))

    def _check_state(self, state) -> int:
        """A one-line ``ValueError`` unless ``state`` is this model's (:meth:`init_state`'s layout: a position and
        one state per block; each block's mixer checks its own); returns the position."""
        layers = state.get("layers") if isinstance(state, dict) else None
        if not isinstance(layers, (list, tuple)) or "position" not in state:
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"state must be this model's state (a dict of 'position' and 'layers': init_state, or a "
                             f"returned state), got {got}")  # fmt: skip
        if len(layers) != len(self.blocks):
            raise ValueError(f"state['layers'] must hold {len(self.blocks)} layer states (one per block), got "
                             f"{len(layers)}")  # fmt: skip
        return int(state["position"])

    def _advance(self, state: dict, tokens: Tensor) -> tuple[Tensor, dict]:
        """:meth:`step` without its checks: nothing read on the host (the position stays a device tensor), the
        same kernels every call, so a constant-size state can replay it from a CUDA graph (``tokens [b, 1]``)."""
        x = self.embed(tokens[:, 0])  # b d
        if self.pos_embed is not None:
            x = x + self.pos_embed.index_select(0, state["position"].reshape(1))  # b d
        new = []
        for block, s in zip(cast("Iterable[_Block]", self.blocks), state["layers"]):
            x, s = block.step(s, x)  # b d
            new.append(s)
        logits = self.norm(x) @ self.embed.weight.t()  # b vocab
        return logits, {"position": state["position"] + 1, "layers": new}

    @torch.no_grad()
    def generate(
        self,
        tokens: Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
        cuda_graph: bool = False,
        token_limit: int | None = None,
    ) -> Tensor:
        """Continue ``tokens [b, n]`` (``n >= 1``) by ``max_new_tokens`` sampled tokens: the prompt in one parallel
        pass, then :meth:`step` per token. ``top_k=1`` is greedy; ``temperature`` divides the logits;
        ``token_limit``: only tokens below it are sampled (a byte model with a larger vocabulary: 256; at or above
        the vocabulary's size it limits nothing).
        ``cuda_graph=True`` replays each step from one CUDA graph (:class:`~lambdanet.models.lm_graph.StepGraph`:
        one launch per token instead of a dozen per block; the lambda and linear families, whose state keeps its
        size; CUDA only). The same tokens as without it, up to the order of floating-point sums.

        Returns:
            ``[b, n + max_new_tokens]``, the prompt first.
        """
        if not isinstance(cuda_graph, bool):
            raise ValueError(f"cuda_graph must be True or False, got {cuda_graph!r}")
        self._check_tokens(tokens, length=False)  # the positions it reads are checked below, with what fits
        tokens = _as_index(tokens)
        if tokens.shape[1] < 1:
            raise ValueError("generate needs a prompt of at least one token per sequence")
        check_int(max_new_tokens, "max_new_tokens", 0)
        max_new_tokens = int(max_new_tokens)
        check_sampling(temperature, top_k, token_limit)
        # the model reads the prompt and every sampled token but the last: positions up to n + max_new_tokens - 2
        n = tokens.shape[1]
        if self.max_len is not None and max(n, n + max_new_tokens - 1) > self.max_len:
            raise ContextTooLongError(n, max_new_tokens, self.max_len)
        was_training = self.training
        self.eval()
        try:
            if cuda_graph:
                StepGraph.check_device(tokens.device)
                if any(isinstance(block.mixer, CausalSelfAttention) for block in self.blocks):  # before the prompt
                    raise GrowingStateError("this model's attention blocks keep a cache that grows with every token")
            logits, state = self(tokens, return_state=True)
            logits, out = logits[:, -1], [tokens]
            graph = None
            for i in range(max_new_tokens):
                nxt = sample_next(logits, temperature, top_k, generator, token_limit)  # b
                out.append(nxt[:, None])
                if i + 1 == max_new_tokens:
                    break
                if not cuda_graph:
                    logits, state = self.step(state, nxt)
                    continue
                if graph is None:  # captured at the first step, from the prompt's state
                    graph = StepGraph(self._advance, state, nxt, name=getattr(self, "model_name", type(self).__name__))
                logits = graph.step(nxt)
        finally:
            self.train(was_training)
        return torch.cat(out, dim=1)


class ContextTooLongError(ValueError):
    """A prompt and a number of new tokens that need more positions than a model of learnt positions has
    (``max_len``): one line saying how long the sequence is and the most that fits; ``flags``: in ``lm sample``'s
    words (``--prompt``'s bytes, ``--max-new-tokens N``)."""

    def __init__(self, prompt: int, new: int, max_len: int, *, flags: bool = False):
        self.prompt, self.new, self.max_len = prompt, new, max_len
        need, fits = max(prompt, prompt + new - 1), max_len - prompt + 1  # generate reads all but the last token
        what, many = ("--prompt", "--max-new-tokens {}") if flags else ("prompt", "max_new_tokens={}")
        if fits < 1:
            hint = f"shorten {what} to at most {max_len} {'bytes' if flags else 'tokens'}"
        else:
            hint = f"at most {many.format(fits)} after this {what}"
        if flags:
            told = f"{what} of {prompt} bytes and {many.format(new)} need {need} positions, but the model has learnt"
            super().__init__(f"{told} {max_len} (max_len, learnt positions): {hint}")
        else:
            told = f"the sequence is {need} tokens long but the model takes at most max_len={max_len}"
            super().__init__(f"{told} (learnt positions): {hint}")


def check_sampling(temperature: float, top_k: int | None, token_limit: int | None) -> None:
    """One-line errors naming the sampling argument that is out of range."""
    temperature = plain_real(temperature)  # numpy's numbers too
    if not (is_finite_real(temperature) and temperature > 0):
        raise ValueError(f"temperature must be > 0 and finite, got {temperature!r}")
    check_positive_int(top_k, "top_k", allow_none=True)
    if token_limit is not None:  # one at or above the vocabulary's size limits nothing
        check_int(token_limit, "token_limit", 1)


def sample_next(
    logits: Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    token_limit: int | None = None,
) -> Tensor:
    """Sample one token per row of ``logits [b, vocab]`` from ``softmax(logits / temperature)`` restricted to
    the ``top_k`` most likely (``top_k=1``: the arg-max, deterministic) and to the tokens below ``token_limit``.
    The logits are shifted by their row's largest and divided in float64, so any finite temperature works: a tiny
    one tends to the arg-max, a huge one to uniform over the tokens kept."""
    check_sampling(temperature, top_k, token_limit)
    if token_limit is not None and token_limit < logits.shape[-1]:
        logits = logits[:, : int(token_limit)]  # b limit: the tokens' indices are unchanged
    if top_k is not None:
        if top_k == 1:
            return logits.argmax(dim=-1)
        kth = logits.topk(min(int(top_k), logits.shape[-1]), dim=-1).values[:, -1:]  # b 1
        logits = logits.masked_fill(logits < kth, float("-inf"))
    logits = logits.double()  # b vocab
    scaled = (logits - logits.max(dim=-1, keepdim=True).values) / float(temperature)  # <= 0, -inf where masked
    probs = F.softmax(scaled, dim=-1).float()  # float32, as always: CUDA's multinomial draws by the dtype
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def _as_index(tokens: Tensor) -> Tensor:
    """Integer tokens as the embedding takes them (``uint8`` bytes, ``int16``, ... -> ``long``)."""
    return tokens if tokens.dtype in (torch.long, torch.int) else tokens.long()


def __getattr__(name: str):
    """The registered models and their argument tables, which lived here before :mod:`lambdanet.models.lm_zoo`
    (``from lambdanet.models.lm import lambda_lm_tiny`` keeps working)."""
    import sys

    zoo = vars(sys.modules.get("lambdanet.models.lm_zoo", object()))  # imported with lambdanet.models, above this
    if name in zoo and not name.startswith("__"):
        return zoo[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
