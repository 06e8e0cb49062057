"""Where bytes live: the flat sharded layout (layout.py), pooled buffers (pool.py), host
buffers outside the C heap (hostmem.py), the measured memory ledger (ledger.py) and the
paper's memory model (estimator.py)."""
from .ledger import CATEGORIES, Census, MemoryReport, formula_bytes, live_tensor_storages, walk_tensors

__all__ = ["CATEGORIES", "Census", "MemoryReport", "formula_bytes", "live_tensor_storages", "walk_tensors"]
