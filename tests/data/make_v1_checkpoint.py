"""Writes tests/data/checkpoint_v1: a checkpoint of format version 1 saved by zerodp 0.1.0
as it was before the package was split into layers, and the parameters one more step
gives after it (tests/test_checkpoint_compat.py loads it with the current code).

    PYTHONPATH=<old checkout>/src python tests/data/make_v1_checkpoint.py
"""
import os
import shutil
import sys

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import zerodp  # noqa: E402
from compat_model import STEPS_BEFORE, TiedNet, config, loss_at  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    torch.manual_seed(0)
    model, opt = zerodp.initialize(TiedNet(), torch.optim.AdamW, config(), lr=1e-2, weight_decay=0.1)
    for step in range(STEPS_BEFORE + 1):
        if step == STEPS_BEFORE:
            out = os.path.join(HERE, "checkpoint_v1")
            shutil.rmtree(out, ignore_errors=True)
            zerodp.save(out, model, opt, note="v1")
        opt.backward(loss_at(model, step))
        opt.step()
        opt.zero_grad()
    save_file({k: v.detach().float().contiguous() for k, v in model.state_dict().items()},
              os.path.join(HERE, "checkpoint_v1_next_step.safetensors"))


if __name__ == "__main__":
    main()
