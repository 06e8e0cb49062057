"""Token dispatch: each (token, chosen expert) pair to the rank that holds the expert, and
the expert's output back, with two all-to-alls over the ``ep`` axis.

[Note: expert dispatch]
The router ran on every rank over its own tokens, as without expert parallelism; the
experts module is called with (hidden_states [T, H], top_k_index [T, K] global expert ids,
top_k_weights [T, K]). The T*K pairs are sorted by expert (a stable sort: ties keep token
order), which groups them by owning rank, since each rank holds a contiguous run of
experts ([Note: expert split] in plan.py). A first all-to-all of counts ([ep_size, E/k]
per rank, the same size everywhere) tells each rank how many rows it gets for each of its
experts from each peer; a second one (an all-to-all-v: its sizes differ between ranks)
sends the rows (on gloo both are tagged point-to-point messages: [Note: gloo all-to-all]
in distributed/collectives.py). The module's own forward then runs on what arrived, top-1
with unit weights and local expert ids, so each row is one expert's output; a third
all-to-all, the second's reverse, brings them home, where they are put back in (token, k)
order, weighted by the router's top-k weights and summed per token: the same terms as the
unsplit module's sum over its chosen experts (dropless: every pair is computed, none
capped). Backward runs the reverse exchanges (`_AllToAll`), so the expert gradients hold
the contributions of the tokens of all k ranks, and the router's weights get theirs on the
token's own rank.

Every rank runs every exchange of every layer, in the same order, with or without tokens
for a peer: a rank whose experts got no token runs them on one zero row, kept in the
autograd graph, so its backward exchanges run too and no peer waits for them (the hang
DeepSpeed #7461 reports for ZeRO-3 with idle experts).
"""
from __future__ import annotations

import torch

from ..distributed import Comm

__all__ = ["ExpertDispatch"]


class _AllToAll(torch.autograd.Function):
    """An all-to-all-v along dim 0 whose backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, comm: Comm, out_splits: list, in_splits: list, label: str):
        ctx.comm, ctx.splits, ctx.label = comm, (out_splits, in_splits), label
        rows = rows.contiguous()
        out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
        comm.all_to_all(out, rows, out_splits, in_splits, "forward", label=label)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _reverse(ctx, grad), None, None, None, None


def _reverse(ctx, grad: torch.Tensor) -> torch.Tensor:
    """The gradient of an exchange's output, sent back the way its rows came."""
    out_splits, in_splits = ctx.splits
    grad = grad.contiguous()
    back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
    ctx.comm.all_to_all(back, grad, in_splits, out_splits, "backward", label=ctx.label)
    return back


class ExpertDispatch:
    """Stands as an experts module's forward: [Note: expert dispatch]. `local_forward` is the
    module's own forward, over its `num_experts` local experts."""

    def __init__(self, local_forward, comm: Comm, num_experts: int, name: str):
        self.local_forward, self.comm, self.name = local_forward, comm, name
        self.ep_size = comm.topology.ep_size
        self.num_experts = num_experts
        self.local = num_experts // self.ep_size

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        tokens, hidden = hidden_states.shape[0], hidden_states.shape[-1]
        top_k = top_k_index.shape[-1]
        expert_ids = top_k_index.reshape(-1)
        order = torch.sort(expert_ids, stable=True).indices
        send = hidden_states.reshape(tokens, hidden).index_select(0, order // top_k)
        counts = torch.bincount(expert_ids, minlength=self.num_experts).view(self.ep_size, self.local)
        received = torch.empty_like(counts)
        self.comm.all_to_all(received, counts, [1] * self.ep_size, [1] * self.ep_size, "forward",
                             label=f"{self.name} counts", uneven=False)
        send_splits, recv_splits = counts.sum(dim=1).tolist(), received.sum(dim=1).tolist()
        rows = _AllToAll.apply(send, self.comm, recv_splits, send_splits, f"{self.name} tokens")
        # Rows arrive peer by peer, each peer's sorted by expert: the local id of each one.
        local_ids = torch.arange(self.local, device=counts.device).repeat(self.ep_size)
        local_ids = local_ids.repeat_interleave(received.reshape(-1), output_size=rows.shape[0]).unsqueeze(-1)
        if rows.shape[0] == 0:  # no token for these experts: one zero row keeps the graph (and the exchanges) whole
            out = self.local_forward(rows.sum(dim=0, keepdim=True), local_ids.new_zeros((1, 1)),
                                     top_k_weights.new_ones((1, 1)))[:0]
        else:
            out = self.local_forward(rows, local_ids, top_k_weights.new_ones(local_ids.shape))
        back = _AllToAll.apply(out, self.comm, send_splits, recv_splits, f"{self.name} outputs")
        # Each pair's row back in (token, k) order: the inverse of `order`, as a gather.
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        per_pair = back.index_select(0, inverse).view(tokens, top_k, hidden)
        weighted = (per_pair * top_k_weights.unsqueeze(-1)).sum(dim=1)
        return weighted.to(hidden_states.dtype)
