"""When gradients are reduced and parameters gathered during a step: one base for the
accumulation boundary, the end of backward and recovery after a failed one (base.py), the
stage 0-2 bucket reducer (reducer.py) and the stage-3 schedule (stage3.py)."""
