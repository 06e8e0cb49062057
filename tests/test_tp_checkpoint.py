"""Checkpoints under tensor parallelism ([Note: tensor-parallel pieces] in
checkpoint/tp_pieces.py): saved at DP x TP = 2 x 2 stage 3 and loaded at 4 x 1 stage 2,
1 x 2 stage 1 and 1 x 1 stage 0, with SGD with momentum and with AdamW. Loading gives the
saved state exactly (weights, fp32 masters, every optimizer state, compared bit for bit by
saving again at the new layout); training on matches one process's uninterrupted run within
the rounding bounds of [Note: rounding bounds of the tensor-parallel tests] (tests/tp_slices.py);
`consolidate` gives the one-process model's state dict; a save killed by SIGKILL leaves the
previous checkpoint the newest and whole. Cases: tp_checkpoint_cases.py."""
import json
import math
import os

import pytest
import torch
from harness import run_world
from tp_cases import GPT_CFG, OPTIMIZERS, STEPS, reference
from tp_checkpoint_cases import SAVE_DP, SAVE_TP, frozen_split_case, killed_while_saving, resume_case, save_case
from tp_slices import CHAIN_ROUNDING, adamw_bound, sgd_bound

import zerodp
from zerodp.checkpoint.format import COMPLETE, METADATA
from zerodp.checkpoint.reader import Reader, open_checkpoint
from zerodp.demo.models import GPT

# (world size, tensor-parallel size, stage) of each load
LOADS = {"4x1 stage 2": (4, 1, 2), "1x2 stage 1": (2, 2, 1), "1x1 stage 0": (1, 1, 0)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, pool):
    root = str(tmp_path_factory.mktemp("tp_ckpt"))
    out = {"root": root}
    for opt_name in OPTIMIZERS:
        out[opt_name] = {"saved": pool.run(4, save_case, root, opt_name, timeout_s=300)}
        for label, (world, tp, stage) in LOADS.items():
            out[opt_name][label] = pool.run(world, resume_case, root, opt_name, tp, stage, timeout_s=300)
    return out


def whole_state(path: str) -> dict:
    """Every saved tensor of a checkpoint by its original coordinates, read in one process:
    (kind, parameter) -> flat tensor, for the master, the compute weights and every state."""
    path, meta, files = open_checkpoint(path)
    out = {}
    with Reader(path, files) as reader:
        for name, info in meta["params"].items():
            numel = math.prod(info["shape"])
            for kind in ["master"] + [f"state/{k}" for k in meta["state_keys"]]:
                out[(kind, name)] = reader.read_runs(kind, name, info, [(0, 0, numel)], numel, torch.float32)
    return out


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("load", list(LOADS))
def test_a_2x2_checkpoint_loads_exactly_at_another_layout(runs, opt_name, load):
    saved = runs[opt_name]["saved"][0]
    resumed = runs[opt_name][load][0]
    # The weights as loaded are the weights as saved, bit for bit, in the original shapes.
    assert resumed["loaded"].keys() == saved["full"].keys()
    for k, v in saved["full"].items():
        assert torch.equal(resumed["loaded"][k], v), k
    # Saving again at the new layout writes the very same state: masters and every optimizer
    # state, element by element, though every piece is cut another way.
    before, after = whole_state(saved["path"]), whole_state(resumed["resaved"])
    assert before.keys() == after.keys()
    assert any(kind.startswith("state/") for kind, _ in before)
    for k, v in before.items():
        assert torch.equal(after[k], v), k
    assert resumed["step_count"] == STEPS
    # A full state dict given to load_pretrained lands in every rank's slice exactly.
    assert all(r["pretrained_equal"] for r in runs[opt_name][load])


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("load", list(LOADS))
def test_training_on_matches_one_uninterrupted_process(runs, opt_name, load):
    ref = reference("gpt", opt_name, SAVE_DP)
    saved, resumed = runs[opt_name]["saved"], runs[opt_name][load]
    # The first loss, averaged over the data-parallel ranks, comes from the same weights and
    # global batch as the reference's: the forward's rounding (step 2 of the note) on
    # magnitudes of the loss's size.
    first = sum(r["losses"][0] for r in saved[::SAVE_TP]) / SAVE_DP
    assert abs(first - ref["losses"][0]) <= CHAIN_ROUNDING * (1 + abs(ref["losses"][0]))
    final = resumed[0]["final"]
    lr = OPTIMIZERS[opt_name][1]["lr"]
    for name, want in ref["params"].items():
        got = final[name]
        diff = (got - want).abs() / (1 + want.abs())
        if opt_name == "sgd":
            bound = sgd_bound(lr, OPTIMIZERS["sgd"][1]["momentum"], ref["grad_max"], clipped_numel=ref["numel"])
        else:
            bound = adamw_bound(lr, [g[name] for g in ref["grads"]], ref["grad_max"], clipped_numel=ref["numel"])
        assert bool((diff <= bound).all()), (name, float((diff - bound).max()))
    # Every tensor-parallel rank of a group computed the same loss.
    _, tp, _ = LOADS[load]
    for r, res in enumerate(resumed):
        assert res["losses"] == resumed[r - r % tp]["losses"], r


def test_the_checkpoint_is_the_one_process_model(runs):
    """The format: original names and shapes, split parameters described and written by each
    tensor-parallel rank, replicated ones once; `consolidate` loads into a plain GPT."""
    path = runs["adamw"]["saved"][0]["path"]
    meta = json.load(open(os.path.join(path, METADATA)))
    assert meta["world_size"] == 4 and meta["tensor_parallel_size"] == 2
    plain = GPT(GPT_CFG)
    shapes = {n: list(p.shape) for n, p in plain.named_parameters()}
    assert {n: info["shape"] for n, info in meta["params"].items()} == shapes
    qkv = meta["params"]["transformer.h.0.attn.c_attn.weight"]  # GPT-2's fused q, k, v: each split alone
    assert qkv["split"] == {"dim": 0, "parts": 3, "size": 2}
    assert {piece[3] for piece in qkv["pieces"]} == {0, 1}
    assert meta["params"]["transformer.h.0.mlp.c_proj.weight"]["split"] == {"dim": 1, "parts": 1, "size": 2}
    norm = meta["params"]["transformer.h.0.ln_1.weight"]
    assert "split" not in norm and {piece[0] % 2 for piece in norm["pieces"]} == {0}  # tensor-parallel rank 0 only
    sd = zerodp.consolidate(path)
    plain.load_state_dict(sd, strict=True)
    for k, v in runs["adamw"]["saved"][0]["full"].items():
        assert torch.equal(sd[k], v), k


def test_an_asynchronous_save_writes_the_same_files(runs):
    for opt_name in OPTIMIZERS:
        saved = runs[opt_name]["saved"][0]
        sync, background = (json.load(open(os.path.join(p, COMPLETE)))["files"]
                            for p in (saved["path"], saved["async"]))
        # rank{r}.safetensors and .json of the 4 ranks, metadata.json, replicated.safetensors
        assert sync == background and len(sync) == 2 * 4 + 2, opt_name


def test_a_save_killed_under_tensor_parallelism_leaves_the_previous_one(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    with pytest.raises(Exception, match="SIGKILL|exited without a result"):
        run_world(4, killed_while_saving, str(root), timeout_s=240)
    names = sorted(os.listdir(root))
    unfinished = [n for n in names if n.startswith("step2.tmp-")]
    assert "step1" in names and "step2" not in names and len(unfinished) == 1, names
    assert not os.path.exists(root / unfinished[0] / COMPLETE)
    assert zerodp.latest(root) == str(root / "step1")
    at_step1 = torch.load(tmp_path / "at_step1.pt")
    consolidated = zerodp.consolidate(root / "step1", dtype=None)
    for k, v in at_step1.items():
        assert torch.equal(consolidated[k], v), k


# (world size, tensor-parallel size, stage) of a save, and of the loads of its checkpoint:
# frozen split parameters written as stage-3 runs and read whole-slice at stages 0-2, and the
# other way round, across tensor-parallel sizes 2 -> 1 and 2 -> 2 with other data ranks.
FROZEN_RUNS = {(4, 2, 3): [(2, 2, 1), (1, 1, 0)], (4, 2, 1): [(4, 1, 3), (2, 2, 3)],
               (2, 1, 1): [(4, 2, 3), (2, 2, 1)]}  # saved without tensor parallelism: replicated whole


@pytest.mark.parametrize("saved_at", list(FROZEN_RUNS))
def test_frozen_parameters_split_by_tensor_parallelism_reshard_across_layouts(pool, tmp_path, saved_at):
    """A frozen base the plan splits is checkpointed by its slices, each written by its
    owner (never whole on one rank), and loads at any layout and stage exactly."""
    world, tp, stage = saved_at
    path = str(tmp_path / "frozen")
    saved = pool.run(world, frozen_split_case, path, tp, stage, True, timeout_s=300)
    want = saved[0]["full"]
    assert all(r["full"].keys() == want.keys() for r in saved)
    meta = json.load(open(os.path.join(path, METADATA)))
    norm = "transformer.h.0.ln_1.weight"  # frozen, never split: replicated at stage 1, runs at stage 3
    if stage == 1:
        assert norm in meta["replicated"] and norm not in meta["frozen"]
    else:
        assert norm not in meta["replicated"] and "split" not in meta["frozen"][norm]
    if tp == 1:
        assert "transformer.h.0.attn.c_attn.weight" in meta["replicated"] and not meta["frozen"]
    else:
        qkv = meta["frozen"]["transformer.h.0.attn.c_attn.weight"]  # written by both tensor-parallel ranks
        assert qkv["split"] == {"dim": 0, "parts": 3, "size": 2} and {p[3] for p in qkv["pieces"]} == {0, 1}
        assert qkv["shape"] == list(want["transformer.h.0.attn.c_attn.weight"].shape)
        # Written once by its owner: a whole slice per tensor-parallel rank at stage 1, by data
        # rank 0 (process ranks 0 and 1); runs of every process at stage 3. Never replicated whole.
        ranks = {p[0] for p in qkv["pieces"]}
        assert ranks == ({0, 1} if stage == 1 else {0, 1, 2, 3}), ranks
        assert "transformer.h.0.attn.c_attn.weight" not in meta["replicated"]
    sd = zerodp.consolidate(path)
    GPT(GPT_CFG).load_state_dict(sd, strict=True)
    for k, v in want.items():
        assert torch.equal(sd[k], v), k
    for load in FROZEN_RUNS[saved_at]:
        for r in pool.run(load[0], frozen_split_case, path, *load[1:], False, timeout_s=300):
            for k, v in want.items():
                assert torch.equal(r["full"][k], v), (load, k)
                assert torch.equal(r["pretrained"][k], v), (load, k)


# (world size, tensor-parallel size, stage) of each DCP load of a 2 x 2 DCP checkpoint.
DCP_LOADS = [(4, 1, 2), (2, 2, 1), (4, 2, 0), (4, 4, 3)]


@pytest.mark.parametrize("stage,frozen", [(3, False), (1, True)], ids=["stage3-adamw", "stage1-frozen-sgd"])
def test_dcp_state_dicts_under_tensor_parallelism_reshard_across_layouts(pool, tmp_path, stage, frozen):
    """`get_state_dict` under tensor parallelism gives DTensors of the original shapes on a
    (tp, shard) mesh (packed projections whole), which DCP saves once per block and loads
    at any layout and stage, and into one process's plain model and torch optimizer: the
    weights, fp32 masters and every optimizer state exactly. Saved at 2 x 2 stage 3 with
    AdamW, and at 2 x 2 stage 1 with SGD with momentum beside a frozen base the plan splits."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    root = str(tmp_path)
    from tp_checkpoint_cases import FROZEN, dcp_load_case, dcp_save_case

    saved = pool.run(4, dcp_save_case, root, stage, frozen, timeout_s=300)
    want = saved[0]["full"]
    ref = whole_state(os.path.join(root, "dcp-ref"))
    for world, tp, load_stage in DCP_LOADS:
        loaded = pool.run(world, dcp_load_case, root, tp, load_stage, frozen, timeout_s=300)
        for r in loaded:
            for k, v in want.items():
                assert torch.equal(r["full"][k], v), (world, tp, load_stage, k)
        after = whole_state(loaded[0]["path"])
        assert after.keys() == ref.keys()
        for k, v in ref.items():
            assert torch.equal(after[k], v), (world, tp, load_stage, k)
    # One process, no zerodp: torch's own model and optimizer read the same checkpoint.
    torch.manual_seed(5)
    plain = GPT(GPT_CFG)
    if frozen:
        for name, p in plain.named_parameters():
            p.requires_grad_(not name.endswith(FROZEN))
        torch_opt, keys = torch.optim.SGD([p for p in plain.parameters() if p.requires_grad], lr=0.5,
                                          momentum=0.9), ("momentum_buffer",)
    else:
        torch_opt, keys = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1), ("exp_avg", "exp_avg_sq")
    msd, osd = get_state_dict(plain, torch_opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=os.path.join(root, "dcp"))
    set_state_dict(plain, torch_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for k, v in plain.state_dict().items():
        assert torch.equal(v, want[k]), k
    for name, p in plain.named_parameters():
        if p.requires_grad:
            for key in keys:
                assert torch.equal(torch_opt.state[p][key].reshape(-1), ref[(f"state/{key}", name)]), (name, key)


def test_state_dicts_under_tensor_parallelism_load_across_stages_and_inside_a_gathered_block(pool):
    """2 x 2: a stage's DTensor state dict loads into a model at another stage (3 -> 2 -> 1 ->
    3) exactly; inside `gathered_parameters` the stage-3 state dict has the original shapes
    and values, and a full state dict loads there with modify=True."""
    from tp_checkpoint_cases import state_dict_forms_case

    plain = {n: tuple(p.shape) for n, p in GPT(GPT_CFG).state_dict().items()}
    for rank, r in enumerate(pool.run(4, state_dict_forms_case, timeout_s=300)):
        want = r["want"]
        for step in ("3->2", "2->1", "1->3", "gathered_load", "gathered_dtensor_load"):
            for k, v in want.items():
                assert torch.equal(r[step][k], v), (rank, step, k)
        assert r["inside_shapes"] == plain, rank
        for k, v in want.items():
            assert torch.equal(r["inside"][k], v), (rank, k)


@pytest.mark.parametrize("stage", [1, 3])
def test_the_model_s_own_save_pretrained_writes_the_whole_model(pool, tmp_path, stage):
    """Under tensor parallelism the state dict holds DTensors at every stage: the model's
    own `save_pretrained`, called on every rank with `is_main_process`, writes the one-process
    model, which `from_pretrained` loads (it wrote each rank's slices at stages 0-2 before)."""
    from tp_checkpoint_cases import save_pretrained_case

    r = pool.run(4, save_pretrained_case, str(tmp_path), stage, timeout_s=300)[0]
    assert r["loaded"].keys() == r["full"].keys()
    for k, v in r["loaded"].items():
        assert torch.equal(v, r["full"][k]), k


def test_dcp_of_a_bf16_hugging_face_llama_under_tensor_parallelism(pool, tmp_path):
    """The user's path: HF Llama (its own tensor-parallel plan and loss), bf16 with fp32
    masters, AdamW, saved through DCP at 2 x 2 stage 3 and loaded at 1 x 2 stage 1 and 4 x 1
    stage 2: weights, masters and moments bit for bit."""
    from tp_checkpoint_cases import dcp_load_case, dcp_save_case

    root = str(tmp_path)
    want = pool.run(4, dcp_save_case, root, 3, False, "llama", timeout_s=300)[0]["full"]
    ref = whole_state(os.path.join(root, "dcp-ref"))
    assert {v.dtype for v in want.values() if v.is_floating_point()} == {torch.bfloat16}  # masters: fp32, in ref
    for world, tp, stage in [(2, 2, 1), (4, 1, 2)]:
        loaded = pool.run(world, dcp_load_case, root, tp, stage, False, "llama", timeout_s=300)
        for r in loaded:
            for k, v in want.items():
                assert torch.equal(r["full"][k], v), (world, tp, stage, k)
        after = whole_state(loaded[0]["path"])
        assert after.keys() == ref.keys()
        for k, v in ref.items():
            assert torch.equal(after[k], v), (world, tp, stage, k)
