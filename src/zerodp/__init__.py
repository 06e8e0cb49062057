"""zerodp: ZeRO data parallelism for PyTorch (Rajbhandari et al., arXiv 1910.02054).

    zerodp.init_distributed()
    model, optimizer = zerodp.initialize(model, torch.optim.AdamW, zerodp.Config(stage=2), lr=3e-4)
"""
from .api import initialize
from .checkpoint import latest, load, save
from .full_state import consolidate, export, load_pretrained
from .comm import CommLedger, init_distributed, shutdown_distributed
from .config import Config, ConfigError
from .estimator import estimate
from .materialize import init
from .memory import MemoryReport
from .optimizer import ZeroOptimizer
from .stage3 import gathered_parameters

__version__ = "0.1.0"

__all__ = [
    "Config", "ConfigError", "CommLedger", "MemoryReport", "ZeroOptimizer",
    "init_distributed", "shutdown_distributed", "init", "initialize", "gathered_parameters",
    "save", "load", "latest", "consolidate", "export", "load_pretrained", "estimate",
    "__version__",
]
