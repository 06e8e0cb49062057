"""gpu_check.py's checks of the features whose collectives are all-to-alls or joins, which NCCL
runs differently from gloo: Ulysses sequence parallelism with the tiled loss and MLP
(docs/long_context.md), expert parallelism (docs/moe.md), and the stage-3 generation context
with the weight stream (docs/rl.md). Each runs bf16 on the device over every rank, against a
plain model trained in one process on every rank from the same seed (LocalReference), and
logs one PASS/FAIL line with its measured differences and their tolerances."""
from __future__ import annotations

import contextlib
import copy
import importlib.util
import math
import os

import torch
import torch.distributed as dist

import zerodp
from zerodp.demo.models import GPT

from gpu_check import CLIP, LOSS_TOL, LR, ULP, agree_max, log, make_zero, master_step, params_of, zero_step

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the models below are built from configs
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

# Tolerances. Three metrics: the loss |a-b| at every step (each rank against the reference's
# loss on the same batch), parameters |a-b| / (1+|b|) per element (gpu_check.py's), and the
# update ratio ||zerodp - reference|| / ||reference - initial|| over the parameters (how far
# zerodp's training moved from the reference's, against how far the reference moved).
# zerodp and the reference run the same bf16 ops on the same tokens and differ by rounding:
# the order of the sums (the k slices' token losses, each over the whole sequence's count;
# the tiles' partial sums of the loss and of the MLP weights' gradients; an expert's matmul
# over the rows every rank sent it instead of one per rank; the N ranks' gradients), which
# AdamW may turn into lr-sized steps of near-zero gradients, and which may flip a token's
# top-k experts. Measured on CPU, gloo, 5 steps, lr 1e-3, 4 rows, largest over 2, 3, 4, 6
# and 8 ranks (SP: the even ones):
#   sequence parallel  loss 2.7e-4   param 5.4e-3   update ratio 0.038
#   expert parallel    loss 3.4e-4   param 4.5e-3   update ratio 0.083 (2 and 4 ranks: 0.044)
#   generation (GPT)   loss 1.7e-4   param 5.1e-3   update ratio 0.047
# and, for scale, the reference against broken copies of itself (the same steps, 2 / 4 ranks):
#   no update at all                    loss 4.7e-3 - 7.8e-3 (SP), 1.6e-3 - 5.1e-3 (EP)  ratio 1
#   SP: a group trained on its own batch (not averaged over the groups, 4 ranks)
#                                       loss 3.3e-3   ratio 0.87
#   SP: the label at the slices' boundary lost                loss 6.5e-3   ratio 0.27
#   EP: one rank's experts' gradients lost  loss <= 3.1e-4 (unseen)   ratio of the banks 0.70 / 0.50
#       (about sqrt(1/N) of the banks left unmoved: 0.35 at 8 ranks)
#   EP: the banks trained on one rank's tokens only           ratio of the banks 0.90 / 1.10
# So the loss keeps gpu_check's bf16 limit, 1e-3: 3x above the noise (room for NCCL's ring
# order and CUDA's kernels), 1.6-8x below those bugs. The ratio's limit, 0.25, sits 3x above
# its noise and below every bug (the boundary label's barely; the loss catches it 6x); an
# expert gradient lost or reduced over the wrong ranks is visible only there (AdamW
# normalises a gradient's scale away, and the per-element bound, gpu_check's 2 lr per step
# + one bf16 ulp, is wider than the whole update: it catches a garbled or misplaced tensor).
UPDATE_TOL = 0.25  # the loss: LOSS_TOL["bf16"]
SP_SEQ, SP = 32, 2  # sequence length (split in SP slices), sequence-parallel size
MOE_SEQ, MOE_EXPERTS = 16, 4
NEW_TOKENS, PROMPT = 8, 8  # the generation check's greedy rollout
# Generation: the stage-3 model in the generation context and the plain model loaded from the
# stream run the same bf16 ops on bitwise-equal weights: their logits are expected equal
# (measured 0 on CPU). A kernel that picks its blocking by the storage's alignment (the
# unit's flat buffer against the plain model's own tensors) may round differently, by about
# one bf16 ulp (2^-8 of 1 + |logit|) per layer the difference crosses: 4 ulps for the 2
# blocks, the final norm and the head. A stale or misplaced weight moves them by O(lr) per
# step or more. Greedy tokens must be the plain model's picks, or tied with them within
# that difference (a tie at an ulp is common with 256 logits in bf16).
LOGIT_TOL = 4 * ULP["bf16"]


def _transformers(name: str) -> bool:
    if importlib.util.find_spec("transformers") is not None:
        return True
    log(f"{name}  SKIP: transformers is not installed (pip install -e '.[hf]')")
    return False


def tokens(step: int, index: int, vocab: int, rows: int, seq: int, device) -> torch.Tensor:
    """Random token ids, the same on every rank for a given (step, index)."""
    g = torch.Generator().manual_seed(1000 * step + index)
    return torch.randint(0, vocab, (rows, seq), generator=g).to(device)


def llama(device):
    """Hugging Face Llama from a tiny config, seed 0: grouped-query attention (4 query heads, 2
    key/value heads), an MLP 4x the hidden size (tiled_mlp: ceil(I / h) = 4 tiles), a
    vocabulary 4x it (tiled_loss: ceil(V / h) = 4 tiles)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SP_SEQ,
                      tie_word_embeddings=False, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).to(device)


def mixtral(experts: int, device):
    """Hugging Face Mixtral from a tiny config, seed 0: `experts` experts, top-2, the
    load-balancing loss part of the loss (tests/moe_cases.py's, a little wider)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=experts,
                        num_experts_per_tok=2, max_position_embeddings=MOE_SEQ, output_router_logits=True,
                        router_aux_loss_coef=0.02, tie_word_embeddings=False, attn_implementation="sdpa")
    return MixtralForCausalLM(cfg).to(device)


def hf_loss(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def rel_diff(mine: dict, theirs: dict) -> float:
    """gpu_check's parameter metric over `mine`'s names; inf if one is not among `theirs`."""
    if not mine or not set(mine) <= set(theirs):
        return math.inf
    return max(float(((p.float() - theirs[n].float()).abs() / (1 + theirs[n].float().abs())).max())
               for n, p in mine.items())


def update_rel(mine: dict, ref, keep=lambda name: True) -> float:
    """||mine - reference|| / ||reference - initial|| over the parameters `keep` names: how far
    zerodp's training moved from the reference's, against how far the reference moved."""
    theirs, initial = ref.params(), ref.initial
    names = [n for n in mine if keep(n)]
    num = sum(float((mine[n].double() - theirs[n].double()).pow(2).sum()) for n in names)
    den = sum(float((theirs[n].double() - initial[n].double()).pow(2).sum()) for n in names)
    return math.sqrt(num / den) if den > 0 else math.inf


class LocalReference:
    """gpu_check.Reference's recipe in one process: a bf16 copy of the model's parameters
    (buffers keep their dtype, as zerodp's cast_buffers=False: a rotary inv_freq stays
    fp32), AdamW on the fp32 originals, torch's clip. Its step's objective is the mean of the
    given batches' losses, as DDP's over its ranks' batches."""

    def __init__(self, model, loss_fn):
        self.loss_fn = loss_fn
        self.master = list(model.parameters())  # deduplicated: a tied weight counted once
        self.compute = copy.deepcopy(model)
        for p in self.compute.parameters():
            p.data = p.data.to(torch.bfloat16)
        self.opt = torch.optim.AdamW(self.master, lr=LR)
        self.initial = self.params()

    def step(self, batches: list) -> list:
        losses = [self.loss_fn(self.compute, b) for b in batches]
        (sum(losses) / len(losses)).backward()
        master_step(self.master, self.compute, self.opt)
        return [float(loss.detach()) for loss in losses]

    def params(self) -> dict:
        """{name: fp32} of the bf16 parameters, under every name (a tied weight's too)."""
        return {n: p.detach().float() for n, p in self.compute.named_parameters(remove_duplicate=False)}


def _train(model, opt, ref: LocalReference, mine, theirs, steps: int) -> float:
    """`steps` steps of zerodp (its batch mine(step)) and of the reference (the batches
    theirs(step), its loss at index i compared with this rank's); the largest loss diff."""
    worst = 0.0
    for step in range(steps):
        ids, i = mine(step)
        loss = hf_loss(model, ids)
        opt.backward(loss)
        opt.clip_grad_norm_(CLIP)
        opt.step()
        opt.zero_grad()
        want = ref.step(theirs(step))[i]
        worst = max(worst, abs(float(loss.detach()) - want))
    return worst


def _verdict(name: str, args, device, loss_diff: float, mine: dict, ref: LocalReference, extra: str = "",
             ok_extra: bool = True, parts=(lambda n: True,)) -> bool:
    """The worst over the ranks of each metric against `ref`, for the parameters `mine` (full,
    fp32, by name), on one line; the update ratio the largest over `parts` (name filters)."""
    param_diff = agree_max(rel_diff(mine, ref.params()), device)
    update = agree_max(max(update_rel(mine, ref, keep) for keep in parts), device)
    loss_diff = agree_max(loss_diff, device)
    ok_extra = agree_max(0.0 if ok_extra else 1.0, device) == 0.0
    param_tol = 2 * LR * args.steps + ULP["bf16"]
    loss_tol = LOSS_TOL["bf16"]
    ok = loss_diff <= loss_tol and param_diff <= param_tol and update <= UPDATE_TOL and ok_extra
    log(f"{name}  loss diff {loss_diff:.1e} (tol {loss_tol:.0e})  param diff {param_diff:.1e} (tol {param_tol:.1e})  "
        f"update ratio {update:.3f} (tol {UPDATE_TOL}){extra}  {'PASS' if ok else 'FAIL'}")
    return ok


def check_sequence_parallel(args, device):
    """Config(sequence_parallel_size=2, tiled_loss=True, tiled_mlp=True) at stage 3 on a tiny
    Hugging Face Llama with grouped-query attention (4 query heads, 2 key/value heads: each
    rank of a pair gets one kv head): every rank of a pair passes its group's full batch;
    the reference trains the untiled model on the mean of the groups' batches, and each rank's
    loss is compared with its group's."""
    name = "stage 3     bf16 sp 2 tiled loss+mlp"
    world = dist.get_world_size()
    if world % SP:
        log(f"{name}  SKIP: sequence_parallel_size={SP} needs an even number of ranks, have {world}")
        return True
    if not _transformers(name):
        return True
    from zerodp.sequence_parallel.tiled_mlp import TiledMLP

    base = llama(device)
    hf = base.config
    ref = LocalReference(base, hf_loss)
    cfg = zerodp.Config(stage=3, mixed_precision="bf16", sequence_parallel_size=SP, tiled_loss=True,
                        tiled_mlp=True)
    model, opt = zerodp.initialize(copy.deepcopy(base), torch.optim.AdamW, cfg, lr=LR)
    groups, group = world // SP, dist.get_rank() // SP
    batch = lambda step, g: tokens(step, g, hf.vocab_size, args.rows, SP_SEQ, device)  # noqa: E731
    loss_diff = _train(model, opt, ref, lambda s: (batch(s, group), group),
                       lambda s: [batch(s, g) for g in range(groups)], args.steps)
    # Both tilings ran: the loss came from the tiled head (no logits), each MLP ran in tiles.
    with torch.no_grad():
        no_logits = model(input_ids=batch(0, group), labels=batch(0, group)).logits is None
    tiles = [m.forward.tiles_run for m in model.modules() if isinstance(m.forward, TiledMLP)]
    tiled = no_logits and len(tiles) == hf.num_hidden_layers and min(tiles) > 0
    return _verdict(name, args, device, loss_diff, params_of(model), ref,
                    f"  tiled loss {no_logits}, mlp tiles run {tiles}", tiled)


def check_expert_parallel(args, device):
    """Config(expert_parallel_size=N) at stage 3 on a tiny Hugging Face Mixtral (top-2 of E
    experts, E/N on each rank, the load-balancing loss on): each rank trains on its own
    batch; the reference trains the unsplit model on the mean of every rank's batch. The
    parameters compared are the stream's (zerodp.iter_full_params), which joins each bank
    over the expert-parallel group: the whole model, as one process holds it."""
    name = "stage 3     bf16 ep N"
    world, rank = dist.get_world_size(), dist.get_rank()
    if world < 2:
        log(f"{name}  SKIP: expert parallelism needs 2 or more ranks, have {world}")
        return True
    if not _transformers(name):
        return True
    experts = world * math.ceil(MOE_EXPERTS / world)  # a multiple of N: E/N experts a rank
    base = mixtral(experts, device)
    hf = base.config
    ref = LocalReference(base, hf_loss)
    cfg = zerodp.Config(stage=3, mixed_precision="bf16", expert_parallel_size=world)
    model, opt = zerodp.initialize(copy.deepcopy(base), torch.optim.AdamW, cfg, lr=LR)
    batch = lambda step, r: tokens(step, r, hf.vocab_size, args.rows, MOE_SEQ, device)  # noqa: E731
    loss_diff = _train(model, opt, ref, lambda s: (batch(s, rank), rank),
                       lambda s: [batch(s, r) for r in range(world)], args.steps)
    stream = {n: t.float().clone() for n, t in zerodp.iter_full_params(model, opt)}
    banks = lambda n: ".experts." in n  # noqa: E731
    return _verdict(f"{name}={world}", args, device, loss_diff, stream, ref,
                    f"  {experts} experts, {experts // world} a rank", parts=(banks, lambda n: not banks(n)))


def _rollout(model, prompt: torch.Tensor, steps: int, follow=None):
    """Greedy tokens after `prompt` (with `follow`, that rollout's tokens instead: a replay),
    each forward over the whole sequence (the bundled GPT has no cache); the ids and each
    forward's last-position logits, fp32."""
    ids, logits = prompt, []
    with torch.no_grad():
        for _ in range(steps):
            logits.append(model(ids)[0][:, -1].float())
            t = ids.shape[1]
            ids = torch.cat([ids, logits[-1].argmax(-1, keepdim=True) if follow is None else follow[:, t:t + 1]], 1)
    return ids, torch.stack(logits)


def _in_context(model, opt, prompt: torch.Tensor, context: bool):
    """A greedy rollout of NEW_TOKENS tokens, in zerodp.generation_context or not (a gather of
    every unit per forward): its ids, logits and the all-gathers the comm ledger recorded."""
    ledger = opt.comm.ledger
    before = len(ledger.current)
    model.eval()
    with zerodp.generation_context(model, opt) if context else contextlib.nullcontext():
        ids, logits = _rollout(model, prompt, NEW_TOKENS)
    model.train()
    return ids, logits, sum(r.op == "all_gather" for r in ledger.current[before:])


def check_generation(args, device):
    """The RL loop at stage 3 (docs/rl.md) on the bundled GPT: train beside the reference,
    with a greedy rollout in zerodp.generation_context before the last step. After it,
    zerodp.iter_full_params streams the whole model: exactly zerodp's own gathered
    parameters, the reference's within the AdamW bound. A rollout in the context gathers
    each unit once (a forward's all-gathers, not one per token) and equals bit for bit the
    rollout gathering per forward (a unit kept from before the step would not); a plain
    model loaded from the stream (a generator's copy) replays it: the same logits within
    LOGIT_TOL, each token its greedy pick (or tied with it within their logit difference)."""
    name = "stage 3     bf16 generation + stream"
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = make_zero(3, "bf16", "tiny", device)
    vocab, seq = model.config.vocab_size, model.config.block_size
    torch.manual_seed(0)
    with torch.device(device):  # gpu_check.build's draw: the weights make_zero drew
        ref = LocalReference(GPT("tiny"), lambda m, b: m(*b)[1])
    batch = lambda step, r: tokens(step, r, vocab, args.rows, seq + 1, device)  # noqa: E731
    prompt = tokens(args.steps, 10_000, vocab, 2, PROMPT, device)
    loss_diff, before = 0.0, None
    for step in range(args.steps):
        if step == args.steps - 1:
            before = _in_context(model, opt, prompt, True)
        ids = batch(step, rank)
        loss = zero_step(model, opt, ids[:, :-1], ids[:, 1:])
        want = ref.step([(b[:, :-1], b[:, 1:]) for b in (batch(step, r) for r in range(world))])[rank]
        loss_diff = max(loss_diff, abs(float(loss) - want))
    stream = {n: t.clone() for n, t in zerodp.iter_full_params(model, opt)}
    own = params_of(model)  # gathered; the tied head's weight under the embedding's name only
    exact = set(own) <= set(stream) and all(torch.equal(stream[n].float(), own[n]) for n in own)
    ids, logits, kept = _in_context(model, opt, prompt, True)
    ids_per_forward, logits_per_forward, per_forward = _in_context(model, opt, prompt, False)
    bitwise = torch.equal(ids, ids_per_forward) and torch.equal(logits, logits_per_forward)
    plain = copy.deepcopy(ref.compute).eval()
    plain.load_state_dict(stream)  # strict: every name of the model's state dict streamed
    _, plain_logits = _rollout(plain, prompt, NEW_TOKENS, follow=ids)
    logit_diff = float(((logits - plain_logits).abs() / (1 + plain_logits.abs())).max())
    picked = plain_logits.gather(-1, ids[:, PROMPT:].T.unsqueeze(-1)).squeeze(-1)
    gap = plain_logits.amax(-1) - picked  # 0 where the token is the plain model's greedy pick
    greedy = int((gap == 0).sum())
    ties_ok = bool((gap <= 2 * (logits - plain_logits).abs().amax(-1)).all())
    moved = not torch.equal(before[1], logits)  # the last step changed the rollout's logits
    ok = (exact and bitwise and logit_diff <= LOGIT_TOL and ties_ok and moved and before[2] == kept
          and kept * NEW_TOKENS == per_forward)
    return _verdict(name, args, device, loss_diff, {n: t.float() for n, t in stream.items()}, ref,
                    f"  stream = gathered {exact}; rollout in the context: {kept} all-gathers ({per_forward} "
                    f"gathering per forward), = that rollout bit for bit {bitwise}, moved by the last step {moved}; "
                    f"the stream's plain model: logit diff {agree_max(logit_diff, device):.1e} (tol {LOGIT_TOL:.1e}), "
                    f"{greedy}/{gap.numel()} tokens its greedy pick", ok)


def parallel_cases(args) -> list:
    """(name, fn) entries for gpu_check.main's case list; each fn(args, device) -> bool."""
    return [("stage 3 bf16 sp 2 tiled", check_sequence_parallel), ("stage 3 bf16 ep N", check_expert_parallel),
            ("stage 3 bf16 generation", check_generation)]
