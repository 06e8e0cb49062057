"""Each rank's random number generator states (torch, CUDA, python, numpy), as JSON.

Under tensor parallelism these are also the split region's streams: each is drawn from the
default generator's state when a column-parallel layer opens the region ([Note:
tensor-parallel random streams] in tensor_parallel/rng.py), so restoring the default
generator restores both, and a checkpoint holds no second state. zerodp.save takes the state
between steps, when the default generator runs the replicated stream: the root module's
forward closes any region it leaves open, and a recomputation in backward has its generator
state put back by torch.utils.checkpoint."""
from __future__ import annotations

import base64
import random

import torch

__all__ = ["rng_state", "set_rng_state"]


def b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def from_b64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def rng_state() -> dict:
    version, internal, gauss = random.getstate()
    state = {"torch": b64(torch.get_rng_state()), "python": [version, list(internal), gauss]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [b64(s) for s in torch.cuda.get_rng_state_all()]
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(from_b64(state["torch"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([from_b64(s) for s in state["cuda"]])
    if "numpy" in state:
        try:
            import numpy as np
        except ImportError:
            return
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
