"""What stage 3 checks around its units' gathers: that no module computes with a shard, and
that a saved activation which is a view of a unit's gathered buffer is packed as such (so
backward finds it gathered again) ([Note: unit storage] in sharding/flat_unit.py)."""
from __future__ import annotations

import torch
import torch.nn as nn

from ..sharding.flat_unit import UnitState


class _UnitView:
    """Marks a saved tensor packed as a view of a unit's gathered buffer."""


class UnitChecks:
    """Stage3Engine's sharded-use guard and saved-tensor packing; a mixin over the engine's units."""

    def _guard_sharded_use(self, model: nn.Module) -> None:
        """A module whose parameters belong to a unit that is not gathered when it runs
        would compute with 1-D shards (wrong shapes on some ranks, a hang on the others).
        Each module holding unit parameters checks, just before its forward, that their
        units are gathered, and raises naming them; registered after the units' own
        hooks, so a unit's gather runs first."""
        unit_of = {id(p): ui for ui, u in enumerate(self.units) for p in u.all_params()}
        for mname, m in model.named_modules():
            mine = [(pname, unit_of[id(p)]) for pname, p in m.named_parameters(recurse=False) if id(p) in unit_of]
            if mine:
                m.register_forward_pre_hook(self._make_sharded_check(mname or "<root>", type(m).__name__, mine))

    def _make_sharded_check(self, mname: str, kind: str, mine: list):
        def hook(module, args):
            # Traced by torch.compile, not run ([Note: hooks stay eager] in schedule/base.py):
            # read there, `mine` would specialise a block's graph to each instance. A compiled
            # frame meets only gathered parameters: a shard fails the graph's shape guards.
            if torch.compiler.is_compiling():
                return
            for pname, ui in mine:
                if self.units[ui].state is UnitState.SHARDED:
                    unit = self.units[ui]
                    raise RuntimeError(
                        f"rank {self.comm.rank}: {mname} ({kind}) ran while its parameter {pname!r} is sharded: "
                        f"stage-3 unit {unit.name} that holds it was not gathered, because that unit's forward "
                        f"does not enclose this call. Units must be modules whose forward runs every use of "
                        f"their parameters: set Config.unit_modules to the model's block class, or run the "
                        f"call inside zerodp.gathered_parameters(...)")
        return hook

    # -- helpers -----------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor):
        if t.layout is not torch.strided:
            return t
        ptr = t.untyped_storage().data_ptr()
        for ui in list(self._live):  # the few gathered units, not every unit
            buffers = self.units[ui].gathered_buffers()
            if not buffers:
                self._live.discard(ui)
            for bi, buf in buffers:
                if ptr == buf.untyped_storage().data_ptr():
                    return (_UnitView, ui, bi, t.storage_offset(), tuple(t.shape), t.stride())
        return t

    def _unpack(self, packed):
        if not (isinstance(packed, tuple) and packed and packed[0] is _UnitView):
            return packed
        _, ui, bi, offset, shape, stride = packed
        unit = self.units[ui]
        if unit.buffer(bi) is None or unit.state is UnitState.SHARDED:
            raise RuntimeError(f"rank {self.comm.rank}: backward needs the parameters of stage-3 unit {unit.name}, "
                               f"which are not gathered: was a parameter of it used outside the unit's forward?")
        unit.wait()
        view = unit.buffer(bi).as_strided(shape, stride, offset)
        # A backward with create_graph=True (a gradient penalty) records what it unpacks in
        # the double-backward graph, which outlives this gather: the pooled buffer is reused
        # by the next forward, so that graph gets a copy of its own.
        return view.clone() if torch.is_grad_enabled() else view
