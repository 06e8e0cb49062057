"""Checkpoints under tensor parallelism (test_tp_checkpoint.py): a run at DP x TP = 2 x 2,
stage 3, saved after its first step, loaded at 4 x 1 stage 2, 1 x 2 stage 1 and 1 x 1
stage 0, each saving again at once (for a bitwise comparison of the state) and training on;
a save cut by SIGKILL. The model, batches and optimizers are tp_cases'; the one-process
reference is tp_cases.reference, run in the test's own process."""
from __future__ import annotations

import os
import signal
import time

import torch

import zerodp
from tp_cases import BATCH, CLIP, STEPS, build, global_batch, loss_of, make_optimizer
from zerodp.checkpoint import files as ckpt_files

SAVE_DP, SAVE_TP, SAVE_STAGE = 2, 2, 3
GLOBAL = SAVE_DP * BATCH  # sequences per step, whatever the layout


def _initialize(seed: int, opt_name: str, tp: int, stage: int, kind: str = "gpt", precision: str = "fp32"):
    model = build(kind, seed=seed)
    cls, kwargs = make_optimizer(opt_name)
    cfg = zerodp.Config(stage=stage, tensor_parallel_size=tp, mixed_precision=precision,
                        **({"unit_min_params": 1000} if stage == 3 else {}))
    return zerodp.initialize(model, cls, cfg, **kwargs)


def _train(model, opt, steps, dp: int, dp_rank: int, kind: str = "gpt") -> list:
    """tp_cases' global batches, this data-parallel rank's share of each."""
    per_rank, losses = GLOBAL // dp, []
    for step in steps:
        ids = global_batch(step, SAVE_DP)[dp_rank * per_rank:(dp_rank + 1) * per_rank]
        loss = loss_of(kind, model, ids)
        opt.backward(loss)
        opt.clip_grad_norm_(CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def save_case(rank: int, world_size: int, root: str, opt_name: str) -> dict:
    """2 x 2 stage 3: the first step, then `root/<opt_name>`, and the whole model then."""
    assert world_size == SAVE_DP * SAVE_TP
    # Every rank seeded differently: training starts from rank 0's weights, the reference's (seed 0).
    model, opt = _initialize(rank, opt_name, SAVE_TP, SAVE_STAGE)
    losses = _train(model, opt, [0], SAVE_DP, opt.comm.rank)
    path = zerodp.save(os.path.join(root, opt_name), model, opt, data_position=1)
    # The same save in the background (its channel spans all 4 ranks): the same files.
    background = zerodp.save(os.path.join(root, f"{opt_name}-async"), model, opt, asynchronous=True,
                             data_position=1).wait()
    full = zerodp.full_state_dict(model, opt, rank0_only=True)
    return {"losses": losses, "path": path, "async": background, "full": full if rank == 0 else None}


def resume_case(rank: int, world_size: int, root: str, opt_name: str, tp: int, stage: int) -> dict:
    """Load `root/<opt_name>` at (world / tp) x tp and `stage`; the whole model as loaded,
    a save at once (`root/<opt_name>-<dp>x<tp>`), then the remaining steps."""
    dp = world_size // tp
    model, opt = _initialize(100 + rank, opt_name, tp, stage)  # other weights: the load must replace them all
    extra = zerodp.load(os.path.join(root, opt_name), model, opt)
    loaded = zerodp.full_state_dict(model, opt, rank0_only=True)
    resaved = zerodp.save(os.path.join(root, f"{opt_name}-{dp}x{tp}"), model, opt)
    losses = _train(model, opt, range(extra["data_position"], STEPS), dp, opt.comm.rank)
    final = zerodp.full_state_dict(model, opt, rank0_only=True)
    # load_pretrained from the one-process state dict: each rank reads its slice's elements.
    whole = zerodp.consolidate(os.path.join(root, opt_name))
    fresh, fresh_opt = _initialize(200 + rank, opt_name, tp, stage)
    zerodp.checkpoint.load_pretrained(fresh, whole, fresh_opt)
    pretrained = zerodp.full_state_dict(fresh, fresh_opt)
    pretrained_equal = all(torch.equal(pretrained[k], v) for k, v in whole.items())
    return {"loaded": loaded, "final": final, "losses": losses, "resaved": resaved, "pretrained_equal":
            pretrained_equal, "step_count": opt.step_count} if rank == 0 else {"losses": losses,
                                                                              "pretrained_equal": pretrained_equal}


def killed_while_saving(rank: int, world_size: int, root: str) -> str:
    """Spawned world of 4 (2 x 2, stage 3, AdamW): a checkpoint after step 0, then a save whose
    rank files are cut to half and every rank SIGKILLed before the commit."""
    model, opt = _initialize(rank, "adamw", SAVE_TP, SAVE_STAGE)
    _train(model, opt, [0], SAVE_DP, opt.comm.rank)
    zerodp.save(os.path.join(root, "step1"), model, opt)
    full = zerodp.full_state_dict(model, opt, rank0_only=True)
    if rank == 0:
        torch.save(full, os.path.join(root, "..", "at_step1.pt"))
    _train(model, opt, [1], SAVE_DP, opt.comm.rank)
    real = ckpt_files.write_safetensors

    def cut(file, tensors):
        real(file, tensors)
        with open(file, "r+b") as f:
            f.truncate(os.path.getsize(file) // 2)
        open(os.path.join(root, "..", f"half{rank}"), "w").close()
        while not all(os.path.exists(os.path.join(root, "..", f"half{r}")) for r in range(world_size)):
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)

    ckpt_files.write_safetensors = cut
    zerodp.save(os.path.join(root, "step2"), model, opt)
    return "not killed"


# A LoRA-like base under tensor parallelism: frozen parameters the plan splits (GPT-2's fused
# q, k, v along dim 0 in 3 packed projections; the MLP's input projection) and a frozen one it
# replicates (a norm), beside trainable ones.
FROZEN = ("attn.c_attn.weight", "mlp.c_fc.weight", "ln_1.weight")


def _frozen_model(seed: int, tp: int, stage: int):
    model = build("gpt", seed=seed)
    for name, p in model.named_parameters():
        if name.endswith(FROZEN):
            p.requires_grad_(False)
    cfg = zerodp.Config(stage=stage, tensor_parallel_size=tp, **({"unit_min_params": 1000} if stage == 3 else {}))
    return zerodp.initialize(model, torch.optim.SGD, cfg, lr=0.5, momentum=0.9)


def frozen_split_case(rank: int, world_size: int, path: str, tp: int, stage: int, saving: bool) -> dict:
    """saving: one step at (world / tp) x tp and `stage`, then a save to `path`; else a load
    of `path` into a model of other weights. Either way the whole model after, from every
    rank (each rank's state dict is complete: frozen values included), and after a load also
    `load_pretrained` of the consolidated checkpoint into a third model."""
    dp = world_size // tp
    model, opt = _frozen_model(rank if saving else 100 + rank, tp, stage)
    if saving:
        _train(model, opt, [0], dp, opt.comm.rank)
        zerodp.save(path, model, opt)
    else:
        zerodp.load(path, model, opt)
    out = {"full": zerodp.full_state_dict(model, opt)}
    if not saving:
        fresh, fresh_opt = _frozen_model(200 + rank, tp, stage)
        zerodp.checkpoint.load_pretrained(fresh, zerodp.consolidate(path), fresh_opt)
        out["pretrained"] = zerodp.full_state_dict(fresh, fresh_opt)
    return out


def _dcp_model(seed: int, tp: int, stage: int, frozen: bool, kind: str):
    if kind == "llama":  # Hugging Face's Llama, bf16 with its fp32 master in the optimizer state dict
        return _initialize(seed, "adamw", tp, stage, kind="llama", precision="bf16")
    return _frozen_model(seed, tp, stage) if frozen else _initialize(seed, "adamw", tp, stage)


def dcp_save_case(rank: int, world_size: int, root: str, stage: int = SAVE_STAGE, frozen: bool = False,
                  kind: str = "gpt") -> dict:
    """2 x 2 at `stage` (AdamW; or SGD with momentum beside the frozen split base of
    `_frozen_model`; or HF Llama in bf16): the first step, then torch.distributed.checkpoint
    (DCP) of `get_state_dict`'s model and optimizer state dicts to `root/dcp`, and zerodp's
    own save of the same state to `root/dcp-ref` for an element-by-element comparison."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = _dcp_model(rank, SAVE_TP, stage, frozen, kind)
    _train(model, opt, [0], SAVE_DP, opt.comm.rank, kind)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(root, "dcp"))
    zerodp.save(os.path.join(root, "dcp-ref"), model, opt)
    return {"full": zerodp.full_state_dict(model, opt)}


def dcp_load_case(rank: int, world_size: int, root: str, tp: int, stage: int, frozen: bool = False,
                  kind: str = "gpt") -> dict:
    """`root/dcp` loaded through DCP at (world / tp) x tp and `stage` into a model of other
    weights; the whole model as loaded, and zerodp's save of the loaded state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    dp = world_size // tp
    model, opt = _dcp_model(100 + rank, tp, stage, frozen, kind)
    msd, osd = get_state_dict(model, opt)  # templates: this layout's DTensors
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=os.path.join(root, "dcp"))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    path = zerodp.save(os.path.join(root, f"dcp-{dp}x{tp}-stage{stage}"), model, opt)
    return {"full": zerodp.full_state_dict(model, opt), "path": path}


def state_dict_forms_case(rank: int, world_size: int) -> dict:
    """2 x 2: the DTensor state dicts of one stage loaded into a model at another (stage 3 into
    2, 2 into 1, 1 into 3), each a model of other weights; inside `gathered_parameters` at
    stage 3 the state dict has the original shapes, and a full state dict loads there. The
    whole model after each (`full_state_dict`), and the shapes seen inside the block."""
    out = {}
    models = {}
    for stage, seed in ((3, rank), (2, 100 + rank), (1, 200 + rank), (3, 300 + rank)):
        models[len(models)] = _initialize(seed, "sgd", SAVE_TP, stage)
    (s3, s3_opt), (s2, s2_opt), (s1, s1_opt), (other3, other3_opt) = models.values()
    _train(s3, s3_opt, [0], SAVE_DP, s3_opt.comm.rank)
    out["want"] = zerodp.full_state_dict(s3, s3_opt)
    s2.load_state_dict(s3.state_dict())
    out["3->2"] = zerodp.full_state_dict(s2, s2_opt)
    s1.load_state_dict(s2.state_dict())
    out["2->1"] = zerodp.full_state_dict(s1, s1_opt)
    other3.load_state_dict(s1.state_dict())
    out["1->3"] = zerodp.full_state_dict(other3, other3_opt)
    with zerodp.gathered_parameters(s3):
        inside = s3.state_dict()
    out["inside_shapes"] = {k: tuple(v.shape) for k, v in inside.items()}
    out["inside"] = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in inside.items()}
    fresh, fresh_opt = _initialize(400 + rank, "sgd", SAVE_TP, 3)
    with zerodp.gathered_parameters(fresh, modify=True, optimizer=fresh_opt):
        fresh.load_state_dict(out["want"])
    out["gathered_load"] = zerodp.full_state_dict(fresh, fresh_opt)
    dtensors = s3.state_dict()  # DTensors, split or not, loaded into gathered units
    other, other_opt = _initialize(500 + rank, "sgd", SAVE_TP, 3)
    with zerodp.gathered_parameters(other, modify=True, optimizer=other_opt):
        other.load_state_dict(dtensors)
    out["gathered_dtensor_load"] = zerodp.full_state_dict(other, other_opt)
    return out


def save_pretrained_case(rank: int, world_size: int, root: str, stage: int) -> dict:
    """HF Llama at 2 x 2: its own `save_pretrained(dir, is_main_process=...)`, called on every
    rank as the Trainer calls it; rank 0 reads the folder back with `from_pretrained`."""
    from transformers import LlamaForCausalLM

    model, opt = zerodp.initialize(build("llama", seed=rank), torch.optim.SGD,
                                   zerodp.Config(stage=stage, tensor_parallel_size=SAVE_TP), lr=0.1)
    full = zerodp.full_state_dict(model, opt)
    path = os.path.join(root, f"pretrained-stage{stage}")
    model.save_pretrained(path, is_main_process=rank == 0)
    torch.distributed.barrier()
    if rank != 0:
        return {}
    loaded = LlamaForCausalLM.from_pretrained(path).state_dict()
    return {"full": full, "loaded": loaded}
