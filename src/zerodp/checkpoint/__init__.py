"""Checkpoints: the format (format.py), atomic file I/O (files.py), reading (reader.py),
sharded save/load at any world size and stage (sharded.py), and a plain model out or in
(consolidated.py), and the model whole from a live run (full_state.py). A save's steps are
saving.py's; an asynchronous save runs its writing and commit on a thread (background.py)."""
from .background import AsyncSave, wait_for_saves
from .consolidated import consolidate, export, load_pretrained
from .format import CheckpointError, InvalidCheckpoint
from .full_state import full_state_dict, save_pretrained
from . import sharded
from .deepspeed_reader import is_deepspeed_checkpoint, load_deepspeed
from .sharded import latest, save


def load(path, model, optimizer) -> dict:
    """`sharded.load` (zerodp's checkpoints); a DeepSpeed ZeRO checkpoint folder (its save_dir
    with `latest`, or a tag folder) is read by `deepspeed_reader.load_deepspeed`."""
    if is_deepspeed_checkpoint(path):
        return load_deepspeed(path, model, optimizer)
    return sharded.load(path, model, optimizer)


__all__ = ["AsyncSave", "CheckpointError", "InvalidCheckpoint", "consolidate", "export", "full_state_dict", "latest",
           "load", "load_deepspeed", "load_pretrained", "save", "save_pretrained", "wait_for_saves"]
