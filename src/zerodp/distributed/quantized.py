"""ZeRO++'s quantized collectives (arXiv 2306.10209 §3.1, §3.3) as a gather/reduce-scatter
strategy: what a stage-3 unit sends changes, nothing above it does.

[Note: blockwise quantization]
A tensor is cut into blocks of `block` elements (the last one padded with zeros); each
block is sent as signed integer codes q = round(x / s), |q| <= qmax (127 for int8, 7 for
int4, two codes per byte), and one fp32 scale s = max|x| / qmax. Dequantized, an element
is off by at most s / 2 = max|x_block| / (2 qmax): 1/254 of its block's largest magnitude
in int8, 1/14 in int4. A block holding a nan or inf gets a nan scale, so a non-finite
gradient stays non-finite through the reduction (and the step's non-finite check sees it).
One payload (codes, then scales, as bytes) per destination keeps every exchange one
collective of equal-sized uint8 chunks.

qwZ: each rank quantizes its shard, the payloads are all-gathered and every rank
dequantizes all of them, its own included, so that every rank computes with the same
weights. qgZ, the hierarchical reduce-scatter: shard rank r = (node r // n, place r % n);
chunk k of the full gradient is owned by rank k. Level 1, inside the node: rank (m, j)
gathers the chunks of every node's place j, {m' n + j}, from its node's n ranks (one
all-to-all of quantized payloads, each chunk quantized on its own, so that a block never
straddles two owners) and sums them dequantized in fp32. Level 2, across nodes:
it re-quantizes each of those M node sums and sends chunk m' n + j to node m' (one
all-to-all among the ranks at place j), then sums the M it receives into its own chunk.
So each level adds at most one quantization error, the sums are fp32, and only 1/n of the
gradient (quantized) crosses nodes. A level over one rank sends nothing and quantizes
nothing. Level 1 (inside the node, the fast link) completes in the call; level 2 (across
nodes) is what overlaps the rest of backward.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from .collectives import Collectives, Works, guarded, pairs_by_order, wire_tag

__all__ = ["QuantizedCollectives", "dequantize", "payload_nbytes", "quantize"]

SCALE_BYTES = 4  # one fp32 scale per block


def _codes_nbytes(numel: int, bits: int, block: int) -> int:
    padded = math.ceil(numel / block) * block
    return padded if bits == 8 else (padded + 1) // 2


def payload_nbytes(numel: int, bits: int, block: int) -> int:
    """Bytes that `numel` elements take quantized: codes, then one scale per block."""
    return _codes_nbytes(numel, bits, block) + SCALE_BYTES * math.ceil(numel / block)


def quantize(x: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """Rows of `x` (2-D, or 1-D as one row) as uint8 payloads, one row each:
    [Note: blockwise quantization]."""
    rows = x.reshape(-1, x.shape[-1]) if x.dim() > 1 else x.reshape(1, -1)
    count, numel = rows.shape
    blocks = math.ceil(numel / block)
    if numel == blocks * block and rows.dtype == torch.float32:
        padded = rows.reshape(count, blocks, block)
    else:
        padded = torch.zeros(count, blocks * block, dtype=torch.float32, device=x.device)
        padded[:, :numel] = rows
        padded = padded.view(count, blocks, block)
    qmax = 2 ** (bits - 1) - 1
    scale = padded.abs().amax(dim=2)  # inf where a block holds one; nan propagates through amax
    finite = torch.isfinite(scale)
    scale = torch.where(finite, torch.where(scale > 0, scale / qmax, torch.ones_like(scale)),
                        torch.full_like(scale, math.nan))
    codes = torch.div(padded, scale.unsqueeze(2)).round_().nan_to_num_(0.0).clamp_(-qmax, qmax)
    codes = codes.to(torch.int8).view(count, -1)
    if bits == 8:
        packed = codes.view(torch.uint8)
    else:
        nibbles = (codes + 8).to(torch.uint8)
        if nibbles.shape[1] % 2:
            nibbles = torch.cat([nibbles, torch.full_like(nibbles[:, :1], 8)], dim=1)
        packed = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)
    return torch.cat([packed, scale.contiguous().view(torch.uint8).view(count, -1)], dim=1)


def dequantize(payload: torch.Tensor, numel: int, bits: int, block: int) -> torch.Tensor:
    """The fp32 rows (`numel` elements each) that `quantize` encoded in `payload`'s rows."""
    rows = payload.reshape(-1, payload.shape[-1]) if payload.dim() > 1 else payload.reshape(1, -1)
    count = rows.shape[0]
    blocks = math.ceil(numel / block)
    codes_nbytes = _codes_nbytes(numel, bits, block)
    packed = rows[:, :codes_nbytes]
    scale = rows[:, codes_nbytes:].reshape(-1).clone().view(torch.float32).view(count, blocks, 1)
    if bits == 8:
        codes = packed.contiguous().view(torch.int8).to(torch.float32)
    else:
        low = (packed & 0x0F).to(torch.int16) - 8
        high = (packed >> 4).to(torch.int16) - 8
        codes = torch.stack([low, high], dim=2).view(count, -1)[:, : blocks * block].to(torch.float32)
    return (codes.view(count, blocks, block) * scale).view(count, -1)[:, :numel]


class QuantizedCollectives(Collectives):
    """ZeRO++ on the shard axis: all-gathers of `weight_bits` codes (qwZ) and/or the
    hierarchical reduce-scatter of `grad_bits` codes over `node` then `cross_node` (qgZ);
    whatever is not quantized goes through `exact`, the axis's plain strategy. The ledger
    records each collective with the bytes it puts on the wire, on the axis it runs on."""

    def __init__(self, exact: Collectives, weight_bits: Optional[int], grad_bits: Optional[int], block: int,
                 node: Optional[Collectives] = None, cross_node: Optional[Collectives] = None):
        super().__init__(exact.group, exact.axis, exact.size, exact.rank, exact.ledger, exact.device, exact.failures)
        if grad_bits is not None and (node is None or cross_node is None
                                      or node.size * cross_node.size != exact.size):
            raise ValueError("the hierarchical reduce-scatter needs node and cross_node axes tiling the shard axis")
        self.exact, self.weight_bits, self.grad_bits, self.block = exact, weight_bits, grad_bits, block
        self.node, self.cross_node = node, cross_node

    # -- qwZ -------------------------------------------------------------------------------
    def all_gather(self, output, input, phase, async_op=False, label=""):
        if self.weight_bits is None or self.size == 1:  # one rank: nothing is sent, nothing quantized
            return self.exact.all_gather(output, input, phase, async_op, label)
        bits, block, n = self.weight_bits, self.block, input.numel()
        self.check_sizes("all_gather", output, input, output)
        record = self.ledger.record("all_gather", output.numel(), self.size * payload_nbytes(n, bits, block), phase,
                                    self.axis, label)
        mine = quantize(input, bits, block).view(-1)
        gathered = torch.empty(self.size * mine.numel(), dtype=torch.uint8, device=input.device)
        work = guarded(record, self.failures, self.exact.launch_all_gather, gathered, mine, True, wire_tag(record))

        def then():
            output.view(self.size, n).copy_(dequantize(gathered.view(self.size, -1), n, bits, block))
        return Works([work], then, record, self.failures).finish(async_op)

    # -- qgZ -------------------------------------------------------------------------------
    def reduce_scatter(self, output, input, phase, async_op=False, label=""):
        if self.grad_bits is None or self.size == 1:
            return self.exact.reduce_scatter(output, input, phase, async_op, label)
        self.check_sizes("reduce_scatter", output, input, input)
        bits, block = self.grad_bits, self.block
        n, m, c = self.node.size, self.cross_node.size, output.numel()
        # Records first, on every rank in the same order ([Note: step fingerprint] in comm.py).
        first = second = None
        if n > 1:
            first = self.ledger.record("all_to_all", n * m * c, n * m * payload_nbytes(c, bits, block), phase,
                                       "node", label)
        if m > 1:
            second = self.ledger.record("all_to_all", m * c, m * payload_nbytes(c, bits, block), phase,
                                        "cross_node", label)
        # Row (j, m') is chunk m' n + j: place j's rows go to local rank j, one chunk a row,
        # so that every block lies in one owner's chunk.
        by_place = input.view(m, n, c).transpose(0, 1).reshape(n * m, c)
        if n == 1:
            return self._across_nodes(output, by_place.float(), second, async_op)
        # Level 1 is waited for here, so level 2 is issued now too: issued later, from a
        # wait, it would come at a different point on each rank (a wait's timing is each
        # rank's own) and could block a rank whose peers are in another collective.
        send = quantize(by_place, bits, block)
        received = torch.empty_like(send)
        guarded(first, self.failures, dist.all_to_all_single, received, send, group=self.node.group,
                async_op=True, agree_on=_agree_on(self.node.group)).wait()
        node_sums = dequantize(received, c, bits, block).view(n, m, c).sum(dim=0)
        return self._across_nodes(output, node_sums, second, async_op)

    def _across_nodes(self, output: torch.Tensor, node_sums: torch.Tensor, record, async_op: bool):
        """Level 2: row m' of `node_sums` (fp32) to node m'; this rank's chunk is the sum of
        what every node sends it."""
        bits, block, m, c = self.grad_bits, self.block, node_sums.shape[0], node_sums.shape[1]
        if m == 1:
            output.copy_(node_sums[0])
            return None
        send = quantize(node_sums, bits, block)
        received = torch.empty_like(send)
        work = guarded(record, self.failures, dist.all_to_all_single, received, send, group=self.cross_node.group,
                       async_op=True, agree_on=_agree_on(self.cross_node.group))

        def then():
            output.copy_(dequantize(received, c, bits, block).sum(dim=0))
        return Works([work], then, record, self.failures).finish(async_op)


def _agree_on(group):
    """The group to agree on before an all-to-all, on gloo ([Note: gloo pairing] in collectives.py)."""
    return group if pairs_by_order(group) else None
