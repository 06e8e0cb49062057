"""A checkpoint written by an earlier layout of the code still loads, and resumes exactly."""
import os

import torch
from safetensors.torch import load_file

import zerodp
from compat_model import STEPS_BEFORE, TiedNet, config, loss_at

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def test_a_version_1_checkpoint_from_before_the_layers_loads_and_resumes_bitwise():
    torch.manual_seed(1)  # another initialisation than the saved run's: load must replace all of it
    model, opt = zerodp.initialize(TiedNet(), torch.optim.AdamW, config(), lr=1e-2, weight_decay=0.1)
    extra = zerodp.load(os.path.join(DATA, "checkpoint_v1"), model, opt)
    assert extra == {"note": "v1"} and opt.step_count == STEPS_BEFORE
    opt.backward(loss_at(model, STEPS_BEFORE))
    opt.step()
    # The old code's next step, saved beside the checkpoint: the same bits (bf16 compute,
    # fp32 master, AdamW states all restored; the step's arithmetic did not change).
    expected = load_file(os.path.join(DATA, "checkpoint_v1_next_step.safetensors"))
    got = {k: v.detach().float() for k, v in model.state_dict().items()}
    assert sorted(got) == sorted(expected)
    for k in expected:
        assert torch.equal(got[k], expected[k]), (k, (got[k] - expected[k]).abs().max())
