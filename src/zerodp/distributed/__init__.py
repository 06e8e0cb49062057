"""Where ranks sit and how bytes move between them: the mesh (topology.py), the one door to
torch.distributed (comm.py), gather/reduce-scatter strategies (collectives.py), the comm
ledger (ledger.py) and the check that every rank was set up alike (agreement.py)."""
from .comm import Comm, init_distributed, shutdown_distributed
from .failure import CollectiveError
from .ledger import CommLedger, CommRecord, PHASES
from .topology import AXES, Topology

__all__ = ["AXES", "CollectiveError", "Comm", "CommLedger", "CommRecord", "PHASES", "Topology", "init_distributed",
           "shutdown_distributed"]
