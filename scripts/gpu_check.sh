#!/usr/bin/env bash
# GPU smoke check: zerodp stages 0-3 x bf16/fp16 against torch DDP on every local GPU
# (NCCL), the fp16 overflow skip, a DCP round trip of the DTensor state dicts, the optimizer
# offloaded to pinned host memory (and stage 3's shards to host/disk, the delayed update),
# torch's clip_grad_norm_ over the model's parameters, ZeRO++'s quantization on the device,
# activation checkpoints on the host (and, with an even number of GPUs, tensor parallelism
# with Pa and Pa+cpu), stage 3 compiled against eager (parity, step time); against a
# one-process reference (scripts/gpu_check_parallel.py): Ulysses sequence parallelism 2 with
# the tiled loss and MLP (even GPU counts), expert parallelism over every GPU (two or more),
# greedy rollouts in the stage-3 generation context and the weight stream; and a stage-3 vs
# DDP benchmark line; a few minutes.
#   bash scripts/gpu_check.sh            # one process per visible GPU
#   bash scripts/gpu_check.sh --cpu      # the same checks on CPU, 2 processes, gloo
# Other arguments go to scripts/gpu_check.py (--steps, --bench-model, --no-bench, ...).
set -euo pipefail
cd "$(dirname "$0")/.."
# bootstrap.sh makes the venv with --system-site-packages, so a CUDA torch that is already
# installed system-wide is used as is.
[ -x .venv/bin/python ] || bash scripts/bootstrap.sh
PY=.venv/bin/python

cpu=0
for a in "$@"; do [ "$a" = "--cpu" ] && cpu=1; done
if [ "$cpu" = 1 ]; then
  # Hide any GPU, so that init_distributed picks gloo and every tensor stays on the CPU;
  # one thread per process, as the two processes share the cores.
  export CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
  nproc=2
else
  # torch's count, not nvidia-smi's: a CPU-only torch build cannot use GPUs nvidia-smi lists.
  nproc=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
  if [ "$nproc" -lt 1 ]; then
    seen=$(nvidia-smi -L 2>/dev/null | wc -l || true)
    echo "gpu_check: no CUDA device visible to torch $("$PY" -c 'import torch; print(torch.__version__)')" \
         "(nvidia-smi lists ${seen:-0} GPUs); run on a CUDA machine, or pass --cpu to check the logic on CPU" >&2
    exit 1
  fi
fi
exec "$PY" -m torch.distributed.run --standalone --nproc_per_node="$nproc" scripts/gpu_check.py "$@"
