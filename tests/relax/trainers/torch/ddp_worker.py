"""One rank of the 2-process gloo DDP test: trains on its half of the batch, saves its weights."""

from __future__ import annotations

import faulthandler
import os
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from tiny import tiny_batch, tiny_qwen2  # noqa: E402

from relax.trainers.torch.trainer import TorchTrainer, sft_loss, wrap_ddp  # noqa: E402

EMPTY_ROWS = (2, 5)  # one empty row on each of the two ranks (rank = row % 2)


def main(rank: int, world: int, rendezvous: str, out: str, steps: int, agg: str, empty: bool = False) -> None:
    """``empty``: rows EMPTY_ROWS get all-zero masks, lr is 0 and rank 0 saves the gradients."""
    faulthandler.dump_traceback_later(90, exit=True)  # a hang shows where it hangs, then fails
    # a file rendezvous: no port to race for with other tests or processes on the machine
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    torch.set_default_dtype(torch.float64)
    model = tiny_qwen2().double()
    ddp = wrap_ddp(model)
    # lr 0 and no clipping: the gradient stays in .grad as the loss made it
    trainer = TorchTrainer(ddp, lr=0.0 if empty else 1e-2, grad_clip=1e9 if empty else 1.0, micro_batch_tokens=24,
                           aggregation=agg, agg_norm=16.0)
    batch = tiny_batch(n=8)
    if empty:
        batch.loss_mask = [m * 0 if i in EMPTY_ROWS else m for i, m in enumerate(batch.loss_mask)]
    mine = batch.select([i for i in range(len(batch)) if i % world == rank])
    for k in range(steps):
        trainer.step(mine, sft_loss)
        print(f"rank {rank} step {k} done", file=sys.stderr, flush=True)
    if rank == 0:
        torch.save({n: p.grad for n, p in model.named_parameters()} if empty else model.state_dict(), out)
    print(f"rank {rank} saved", file=sys.stderr, flush=True)
    dist.destroy_process_group()
    print(f"rank {rank} destroyed", file=sys.stderr, flush=True)
    # gloo's background threads can hang interpreter teardown (seen here 1 run in 3): exit hard,
    # everything this worker had to do is done and written
    os._exit(0)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6],
         sys.argv[7:] == ["empty"])
