"""From a user's model to sharded storage: model preparation (prepare.py: dtype policy,
replication), meta-device materialisation (meta_init.py), flat param groups for stages 0-2
(flat_group.py), stage-3 units (units.py: which; flat_unit.py: their storage), and the
builders that put them together (shard.py)."""
