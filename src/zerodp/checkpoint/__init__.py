"""Checkpoints: the format (format.py), atomic file I/O (files.py), reading (reader.py),
sharded save/load at any world size and stage (sharded.py), and a plain model out or in
(consolidated.py), and the model whole from a live run (full_state.py). A save's steps are
saving.py's; an asynchronous save runs its writing and commit on a thread (background.py)."""
from .background import AsyncSave, wait_for_saves
from .consolidated import consolidate, export, load_pretrained
from .format import CheckpointError, InvalidCheckpoint
from .full_state import full_state_dict, save_pretrained
from .sharded import latest, load, save

__all__ = ["AsyncSave", "CheckpointError", "InvalidCheckpoint", "consolidate", "export", "full_state_dict", "latest",
           "load", "load_pretrained", "save", "save_pretrained", "wait_for_saves"]
