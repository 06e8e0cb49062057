"""zerodp: ZeRO data parallelism for PyTorch (Rajbhandari et al., arXiv 1910.02054).

    zerodp.init_distributed()
    model, optimizer = zerodp.initialize(model, torch.optim.AdamW, zerodp.Config(stage=2), lr=3e-4)
"""
from .api import initialize
from .comm import CommLedger, init_distributed
from .config import Config, ConfigError
from .memory import MemoryReport
from .optimizer import ZeroOptimizer

__version__ = "0.1.0"

__all__ = ["Config", "ConfigError", "CommLedger", "MemoryReport", "ZeroOptimizer", "init_distributed",
           "initialize", "__version__"]
