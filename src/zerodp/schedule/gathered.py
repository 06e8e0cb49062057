"""`gathered_parameters`: stage-3 parameters whole on every rank inside a block."""
from __future__ import annotations

import contextlib
import weakref
from typing import Iterable, Iterator, Union

import torch
import torch.nn as nn

__all__ = ["gathered_parameters", "register_engine"]

# Model -> its stage-3 engine, for gathered_parameters(); weak both ways (the engine holds
# the model), so that a model and its optimizer die when the user drops them.
_ENGINES: "weakref.WeakKeyDictionary[nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()


def register_engine(module: nn.Module, engine) -> None:
    """`engine` (a Stage3Engine) drives the units of the model whose last unit is `module`."""
    _ENGINES[module] = weakref.ref(engine)


@contextlib.contextmanager
def gathered_parameters(target: Union[nn.Module, Iterable[nn.Parameter]], modify: bool = False,
                        optimizer=None) -> Iterator[None]:
    """Full parameters present on every rank inside the block. With `modify=True`, rank
    0's values are written back to every rank's shard on exit (and to the fp32 master
    if `optimizer` is given), as DeepSpeed's GatheredParameters(modifier_rank=0) does.
    Outside stage 3 the parameters are already full; the block is still a valid no-op."""
    if optimizer is not None:
        optimizer.settle()  # a delayed update lands before the parameters are read or edited
    params = list(target.parameters()) if isinstance(target, nn.Module) else list(target)
    wanted = {id(p) for p in params}
    chosen: list = []  # (engine, unit)
    for engine in [ref() for ref in list(_ENGINES.values())]:
        if engine is None:
            continue
        for unit in engine.units:
            if any(id(p) in wanted for p in unit.all_params()):
                chosen.append((engine, unit))
    # Every chosen unit is gathered at once: a one-off peak the pools give back on exit
    # (kept, it would hold the whole model's parameters for the rest of the run).
    marks = {id(unit.pool): (unit.pool, unit.pool.mark()) for _, unit in chosen}
    for engine, unit in chosen:
        engine.gather(engine.units.index(unit))
    try:
        yield
    finally:
        if modify:
            with torch.no_grad():
                for engine, unit in chosen:
                    # Over the unit's own ranks: an expert bank's are those that hold its experts.
                    if not unit.empty:
                        unit.comm.broadcast(unit.full, 0, "init")
                        unit.shard.copy_(unit.own_chunk(unit.full))
                    for part in unit.frozen:
                        unit.comm.broadcast(part.full, 0, "init")
                        part.write_back()
                if optimizer is not None:
                    optimizer.refresh_master_from_params()
        for _, unit in chosen:
            unit.reshard()
        for pool, mark in marks.values():
            pool.release_since(mark)
