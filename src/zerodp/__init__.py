"""zerodp: ZeRO data parallelism for PyTorch (Rajbhandari et al., arXiv 1910.02054).

    zerodp.init_distributed()
    model, optimizer = zerodp.initialize(model, torch.optim.AdamW, zerodp.Config(stage=2), lr=3e-4)
"""
from .api import initialize
from .checkpoint import (consolidate, export, full_state_dict, latest, load, load_pretrained, save, save_pretrained,
                         wait_for_saves)
from .checkpoint.streaming import iter_full_params
from .config import Config, ConfigError
from .distributed import CollectiveError, CommLedger, Topology, init_distributed, shutdown_distributed
from .memory.estimator import estimate
from .memory.ledger import MemoryReport
from .optim import ZeroOptimizer
from .optim.multi import OptimizerList, split_hidden_matrices
from .schedule.generation import generation_context
from .schedule.gathered import gathered_parameters
from .sharding.meta_init import init
from .version import __version__

__all__ = [
    "CollectiveError", "Config", "ConfigError", "CommLedger", "MemoryReport", "Topology", "ZeroOptimizer",
    "init_distributed", "shutdown_distributed", "init", "initialize", "gathered_parameters",
    "save", "load", "latest", "consolidate", "export", "load_pretrained", "estimate",
    "full_state_dict", "save_pretrained", "wait_for_saves", "OptimizerList", "split_hidden_matrices",
    "iter_full_params", "generation_context",
    "__version__",
]
