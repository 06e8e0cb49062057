"""The end of a zerodp script, many times: test_exit_path.py launches this file under
torchrun, one fork server per rank.

Each iteration forks a child per rank that is a whole training script: it joins a fresh
process group (`zerodp.init_distributed`, on the torchrun agent's store under a prefix of
its own), builds a stage-3 model, resumes from a checkpoint (`zerodp.load`), trains two
steps, saves (asynchronously or not), optionally calls `zerodp.shutdown_distributed()`, and
returns. Its interpreter then exits as a script's does: atexit handlers, finalization, the
C++ runtime's static destructors (never os._exit). The model and optimizer are kept to the
end, as a script's module-level ones are, so the process groups they hold are alive when
the interpreter finalizes.

The last exit handler of a child (registered before zerodp's, so it runs after them)
writes `exit-<iteration>-<rank>.json`: whether the default group is still joined, and how
many of the process groups created by the save (the checkpoint channel) are still alive.
Each server prints one JSON line: its children's wait statuses, in order.

The server imports torch and zerodp once, before any thread starts, so an iteration costs a
fork and a process group rather than two interpreters' imports.
"""
from __future__ import annotations

import atexit
import json
import os
import sys
import weakref

_REPORT: dict = {}


def _report_at_exit() -> None:
    if not _REPORT:  # the server itself
        return
    import torch.distributed as dist

    _REPORT["joined_at_exit"] = dist.is_initialized()
    _REPORT["save_groups_alive"] = sum(ref() is not None for ref in _REPORT.pop("save_groups"))
    with open(_REPORT.pop("path"), "w") as f:
        json.dump(_REPORT, f)


atexit.register(_report_at_exit)  # before zerodp's exit handlers are registered: it runs after them

import argparse  # noqa: E402
import gc  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import zerodp  # noqa: E402

# What each script does at its end, in turn: an asynchronous save left for the exit to
# commit, a synchronous one, and each followed by zerodp.shutdown_distributed().
MODES = ("async", "sync", "async+shutdown", "sync+shutdown")
LIVE: list = []  # the scripts' model and optimizer, kept to the end


def _groups() -> dict:
    return {pg.group_name: weakref.ref(pg) for pg in dist.distributed_c10d._world.pg_map}


def script(root: str, iteration: int, mode: str) -> None:
    """One training script, up to its return."""
    torch.manual_seed(0)
    rank, _ = zerodp.init_distributed(timeout_s=60)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(3)])
    config = zerodp.Config(stage=3, unit_modules=(torch.nn.Sequential,), collective_timeout_s=60)
    model, opt = zerodp.initialize(model, torch.optim.AdamW, config, lr=1e-3)
    LIVE.append((model, opt))
    first = os.path.join(root, "first")
    if iteration == 0:
        zerodp.save(first, model, opt)
    else:
        zerodp.load(first, model, opt)
    for step in range(2):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank))
        opt.backward(model(x).square().mean())
        opt.step()
        model.zero_grad(set_to_none=True)
    before = _groups()
    zerodp.save(os.path.join(root, f"step{iteration}"), model, opt, asynchronous=mode.startswith("async"))
    _REPORT.update(path=os.path.join(root, f"exit-{iteration}-{rank}.json"), mode=mode,
                   save_groups=[ref for name, ref in _groups().items() if name not in before])
    if mode.endswith("+shutdown"):
        zerodp.shutdown_distributed()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("root")
    p.add_argument("--iterations", type=int, default=len(MODES))
    args = p.parse_args()
    rank = int(os.environ["RANK"])
    # Before the first fork: what every child would import on its own (an optimizer's first
    # construction imports torch._dynamo, 4 s), and the server's objects frozen out of the
    # collector, so that a child's exit does not copy and sweep them (2 s down to 0.5 s).
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
    gc.freeze()
    statuses = []
    for i in range(args.iterations):
        pid = os.fork()
        if pid == 0:
            # init_distributed keys each torchrun attempt's group by its restart count.
            os.environ["TORCHELASTIC_RESTART_COUNT"] = f"fork{i}"
            script(args.root, i, MODES[i % len(MODES)])
            return  # the child's interpreter exits from here, as a script's does
        statuses.append(os.waitpid(pid, 0)[1])
    print(json.dumps({"rank": rank, "statuses": statuses}), flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
