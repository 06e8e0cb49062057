"""The demo beside the engine: `zerodp train` (train.py), the bundled GPT (models.py), its
byte-level corpus (data.py) and the run's plots (plotting.py, needs the `plot` extra).
The engine never imports it."""
