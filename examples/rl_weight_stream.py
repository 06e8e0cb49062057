"""An RL loop's weight sync with zerodp stage 3: a generator process stands for vLLM (a plain
model that loads the weights it is sent and samples the rollouts); the trainer ranks train
the policy on those rollouts and, after each step, stream the new weights to it, one unit
gathered at a time (`zerodp.iter_full_params`).

    zerodp launch --nproc 2 examples/rl_weight_stream.py --steps 4
    zerodp launch --nproc 2 examples/rl_weight_stream.py --steps 4 --lora   # adapters trained, merged weights sent

A GPT-2 built from a small config (nothing downloaded; in practice `from_pretrained`). Rank 0
starts the generator (`multiprocessing`, spawned) and is the only rank that talks to it: the
stream runs on every rank (it gathers) with `rank=0`, so rank 0 alone yields the tensors and
sends them through a pipe; the generator copies each into its own model as it arrives, as
vLLM's `load_weights` does. A rollout: the generator samples completions, rank 0 broadcasts
them, each rank trains on its share (a toy reward, group-normalised advantages, the
policy-gradient loss). At the end the generator's weights are compared with
`zerodp.full_state_dict` (with --lora, the merged weights), and each rank prints what it holds.
"""
import argparse

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import zerodp
from zerodp.memory.allocations import TensorAllocations

VOCAB, PROMPTS, GENERATIONS, PROMPT_LEN, NEW_TOKENS = 256, 4, 4, 8, 12


def build_base():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=4, n_head=4, n_positions=64,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def generator(conn) -> None:
    """The second process: a plain model that loads streamed weights and samples rollouts."""
    model = build_base().eval()
    params = model.state_dict()  # the tensors load_weights would write into, by name
    while True:
        message = conn.recv()
        if message[0] == "load":  # one tensor of the stream
            _, name, values = message
            params[name].copy_(torch.from_numpy(values))
        elif message[0] == "generate":
            _, prompts, seed = message
            torch.manual_seed(seed)
            with torch.no_grad():
                out = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True, top_k=0,
                                     max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=0)
            conn.send(out)
        elif message[0] == "state":
            conn.send({k: v.clone() for k, v in model.state_dict().items()})
        else:
            return


def sync_weights(model, optimizer, conn) -> dict:
    """Every rank reads the stream (its gathers are collective); rank 0 sends each tensor as it
    comes and drops it. Returns the tensor memory the stream added on this rank, at its worst."""
    with TensorAllocations() as added:
        for name, tensor in zerodp.iter_full_params(model, optimizer, rank=0):
            conn.send(("load", name, tensor.numpy()))  # its bytes down the pipe, as a socket would take them
        tensor = None
    return {"stream_peak_added": added.peak_nbytes}


def loss_of(model, seqs):
    completion = seqs[:, PROMPT_LEN:]
    reward = (completion % 2 == 0).float().sum(dim=1)  # toy: how many new tokens have an even id
    groups = reward.view(-1, GENERATIONS)
    advantage = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)).view(-1)
    logits = model(input_ids=seqs).logits[:, PROMPT_LEN - 1:-1]
    logp = torch.log_softmax(logits, dim=-1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)
    return -(advantage * logp.sum(dim=1)).mean()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--lora", action="store_true", help="train LoRA adapters; the generator gets the merged weights")
    args = ap.parse_args()
    zerodp.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    policy = build_base()
    if args.lora:
        from peft import LoraConfig, get_peft_model
        policy = get_peft_model(policy, LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn", "c_fc"],
                                                   fan_in_fan_out=True, lora_dropout=0.0))
    model, optimizer = zerodp.initialize(policy, torch.optim.AdamW, zerodp.Config(stage=3), lr=1e-3)
    conn = None
    if rank == 0:
        ours, theirs = mp.get_context("spawn").Pipe()
        process = mp.get_context("spawn").Process(target=generator, args=(theirs,), daemon=True)
        process.start()
        conn = ours
    memory = sync_weights(model, optimizer, conn)  # the generator starts from the trainer's weights
    share = PROMPTS * GENERATIONS // world
    for step in range(args.steps):
        rollout = [None]
        if rank == 0:
            prompts = torch.randint(0, VOCAB, (PROMPTS, PROMPT_LEN), generator=torch.Generator().manual_seed(step))
            conn.send(("generate", prompts.repeat_interleave(GENERATIONS, dim=0), step))
            rollout = [conn.recv()]
        dist.broadcast_object_list(rollout, src=0)
        seqs = rollout[0][rank * share:(rank + 1) * share]
        loss = loss_of(model, seqs)
        optimizer.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        memory = sync_weights(model, optimizer, conn)
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}, weights streamed to the generator", flush=True)
    # The generator now holds exactly what the trainer would save.
    if args.lora:
        from zerodp.integrations.peft import merged_state_dict
        want = merged_state_dict(model, optimizer)
    else:
        want = zerodp.full_state_dict(model, optimizer, rank0_only=True)
    if rank == 0:
        conn.send(("state",))
        got = conn.recv()
        same = sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
        print(f"generator's weights == the trainer's{' merged' if args.lora else ''} weights: {same}", flush=True)
        conn.send(("stop",))
        process.join()
    report = optimizer.memory_report()
    unit = max(u.full_nbytes for u in optimizer.stage3.units)
    full = sum(p.numel() * p.element_size() for p in build_base().parameters())
    for r in range(world):
        if r == rank:
            print(f"rank {rank}: model state {report.model_state / 2**20:.2f} MiB (the whole model: "
                  f"{full / 2**20:.2f} MiB of weights alone); largest unit {unit / 2**20:.2f} MiB; the stream "
                  f"added at most {memory['stream_peak_added'] / 2**20:.2f} MiB "
                  f"({memory['stream_peak_added'] / unit:.2f} units)", flush=True)
        dist.barrier()
    zerodp.shutdown_distributed()


if __name__ == "__main__":
    main()
