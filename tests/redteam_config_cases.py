"""Ranks that disagree on the tensor-parallel plan, at world size 2 (tensor_parallel_size=2), a
case per test in the session's world of 2 (test_redteam_config.py): zerodp.initialize must
raise on every rank, naming the plan, instead of passing and leaving the first forward to
wait out the collective timeout."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import torch
import torch.nn as nn

import zerodp
from zerodp.demo.models import GPT, GPTConfig

GPT_CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16)
# Short, so that a rank left waiting by a plan that slipped through fails the case in seconds.
TIMEOUT_S = 20.0


class TinyHF(nn.Module):
    """A model shaped like a Hugging Face one: no plan of its own, its config's
    `base_model_tp_plan` instead."""

    def __init__(self, base_model_tp_plan: dict):
        super().__init__()
        self.config = SimpleNamespace(base_model_tp_plan=base_model_tp_plan)
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _rank_1_plan(how: str) -> Optional[dict]:
    """Rank 1's plan for the bundled GPT: the same modules split another way, fewer modules
    split, or (None) the class's own plan, as on rank 0."""
    plan = dict(GPT.tensor_parallel_plan)
    if how == "other_style":  # still splits every weight evenly: only the plan tells the ranks apart
        plan["transformer.h.*.mlp.c_fc"], plan["transformer.h.*.mlp.c_proj"] = "rowwise", "colwise"
    elif how == "fewer_modules":
        del plan["transformer.h.*.mlp.c_fc"], plan["transformer.h.*.mlp.c_proj"]
    else:
        return None
    return plan


def plan_disagreement(rank: int, world_size: int, how: str) -> Optional[str]:
    """initialize's error on this rank ("Type: message"), or None where it passed."""
    torch.manual_seed(0)
    if how == "hf_base_plan":
        plan = {"up": "colwise", "down": "rowwise"} if rank == 0 else {"up": "colwise"}
        model = TinyHF(plan)
    else:
        model = GPT(GPT_CFG)
        own = _rank_1_plan(how)
        if rank == 1 and own is not None:
            model.tensor_parallel_plan = own
    config = zerodp.Config(stage=2, tensor_parallel_size=2, collective_timeout_s=TIMEOUT_S)
    try:
        zerodp.initialize(model, torch.optim.SGD, config, lr=0.1)
    except Exception as e:  # noqa: BLE001 - the error is what the test asserts on
        return f"{type(e).__name__}: {e}"
    return None
