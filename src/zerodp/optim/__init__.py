"""The sharded optimizer (optimizer.py) over the user's own optimizer (inner.py): fp32
master shards and where they live (master.py), loss scaling (precision.py), the global
gradient norm and non-finite check (clipping.py)."""
from .optimizer import OwnedSlice, ZeroOptimizer

__all__ = ["OwnedSlice", "ZeroOptimizer"]
