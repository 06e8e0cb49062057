"""Sequence-tiled MLP (ALST, arXiv 2506.13996): each layer's MLP computed a tile of tokens at a
time, each tile recomputed in backward, so that no [tokens, intermediate] tensor of a rank's
sequence exists at once.

[Note: tiled MLP]
A transformer's MLP is position-wise: token t's output reads token t's input only. Its
intermediate, [T, I] with I ~ 2.7-4 H (gate, up and their product for a gated MLP, the
pre-activation and its GELU for GPT's), is kept for backward and is, after the logits
([Note: tiled logits and loss]), the largest activation of a layer: 4-11 times the layer's
input [T, H]. With `Config.tiled_mlp`, the forward of every module registered as a layer's
`mlp` (Hugging Face's decoder layers, the bundled GPT's Block) is set on the instance to:
split the input along its sequence dim into n tiles, run the MLP's own forward on each under
a non-reentrant activation checkpoint (`torch.utils.checkpoint`), concatenate. A tile's
intermediate is freed as soon as its output exists; in backward, autograd runs the ready node
created last first, and every node of tile j+1 was created after every node of tile j, so
the tiles' backwards run one whole tile after another, each recomputing only its own forward:
one tile's intermediate lives at a time, forward and backward. The results are those of the
untiled MLP up to the order of the weight gradients' sums (one partial sum per tile).

n = max(ceil(I / H), ceil(T / H)) tiles of the T = batch x sequence tokens (at most one per
position): a tile's intermediate is at most the size of the layer's input [T, H] at short
sequences, and of at most about H tokens at long ones (ALST's tile: an intermediate of about
a weight's size, [H, I], whatever T), so that the MLP adds nothing that grows with T but its
input and output.

Stage 3: the tiles run inside the MLP's own call, so inside the unit that holds it, and their
recomputation runs in that unit's backward, after the gradient hook on the unit's outputs has
gathered its parameters again; the recomputed forward reads the module's parameters as it
finds them then (gathered), never a copy saved from the forward. A forward without gradients
(evaluation; a layer checkpointed with use_reentrant=True runs its first forward so) runs the
tiles without checkpoints. Refused: mixtures of experts (their router's statistics are
recorded per call, which tiles would split); the combinations `check_sequence_parallel` names.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from ..config import ConfigError

__all__ = ["TiledMLP", "apply_tiled_mlp", "mlp_tiles"]


def mlp_tiles(tokens: int, positions: int, hidden: int, intermediate: int) -> int:
    """How many tiles an MLP of width `hidden` -> `intermediate` runs `tokens` tokens (over
    `positions` sequence positions) in: [Note: tiled MLP]."""
    n = max(math.ceil(intermediate / hidden), math.ceil(tokens / hidden))
    return max(1, min(n, positions))


def _widths(mlp: nn.Module) -> tuple[int, int]:
    """(hidden, intermediate) of an MLP: its first weight's input and output widths (Linear's
    [out, in]; transformers' Conv1D of GPT-2 stores [in, out])."""
    first = next((m for m in mlp.modules() if getattr(m, "weight", None) is not None and m.weight.dim() == 2), None)
    if first is None:
        raise ConfigError(f"Config.tiled_mlp: {type(mlp).__name__} holds no 2-D weight to tile around: use "
                          f"tiled_mlp=False")
    out_features, in_features = first.weight.shape
    if type(first).__name__ == "Conv1D":
        out_features, in_features = in_features, out_features
    return in_features, out_features


class TiledMLP:
    """An MLP's forward, set on the instance: [Note: tiled MLP]."""

    def __init__(self, mlp: nn.Module):
        self.base = mlp.forward  # the module's own forward, bound
        self.hidden, self.intermediate = _widths(mlp)
        self.tiles_run = 0  # tiles computed in forward (recomputations not counted)

    def __call__(self, x: torch.Tensor, *args, **kwargs):
        if not torch.is_tensor(x) or x.dim() < 2:
            return self.base(x, *args, **kwargs)
        dim = x.dim() - 2  # the sequence dim: [..., positions, hidden]
        positions = x.shape[dim]
        n = mlp_tiles(x.numel() // x.shape[-1], positions, self.hidden, self.intermediate)
        if n == 1:
            return self.base(x, *args, **kwargs)
        length = math.ceil(positions / n)
        outs = []
        for start in range(0, positions, length):
            tile = x.narrow(dim, start, min(length, positions - start))
            if torch.is_grad_enabled():
                out = checkpoint(self.base, tile, *args, use_reentrant=False, **kwargs)
            else:
                out = self.base(tile, *args, **kwargs)
            if not torch.is_tensor(out):
                raise TypeError(f"Config.tiled_mlp: the MLP returned {type(out).__name__}, not a tensor of its "
                                f"tokens' outputs: use tiled_mlp=False for this model")
            outs.append(out)
            self.tiles_run += torch._C._current_graph_task_id() == -1  # not a recomputation in backward
        return torch.cat(outs, dim=dim)


def apply_tiled_mlp(model: nn.Module) -> list[TiledMLP]:
    """Set [Note: tiled MLP] on every module registered as some module's `mlp`; raises
    ConfigError naming the fix when there is none, or one is a mixture of experts."""
    found = [(name, m) for name, m in model.named_modules() if name.rsplit(".", 1)[-1] == "mlp"]
    if not found:
        raise ConfigError(f"Config.tiled_mlp: {type(model).__name__} has no layer whose MLP is its `mlp` "
                          f"submodule (a Hugging Face decoder layer's, the bundled GPT's Block's): use "
                          f"tiled_mlp=False")
    for name, mlp in found:
        if any(child.rsplit(".", 1)[-1] == "experts" for child, _ in mlp.named_modules()):
            raise ConfigError(f"Config.tiled_mlp: {name} ({type(mlp).__name__}) routes tokens to experts, and its "
                              f"router's statistics are recorded per call, which tiles would split: use "
                              f"tiled_mlp=False for a mixture-of-experts model")
    tiled = [TiledMLP(mlp) for _, mlp in found]
    for (_, mlp), forward in zip(found, tiled):
        mlp.forward = forward
    return tiled
