"""Checkpoints: the format (format.py), atomic file I/O (files.py), reading (reader.py),
sharded save/load at any world size and stage (sharded.py), and a plain model out or in
(consolidated.py)."""
from .consolidated import consolidate, export, load_pretrained
from .format import CheckpointError
from .sharded import latest, load, save

__all__ = ["CheckpointError", "consolidate", "export", "latest", "load", "load_pretrained", "save"]
