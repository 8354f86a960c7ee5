"""A minimal DDP training loop under a byte budget (docs/distributed.md shows this file as it is).

    PYTHONPATH=. torchrun --standalone --nproc_per_node=2 examples/train_ddp.py
"""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import autoremat
from examples.models import transformer_stack

dist.init_process_group("gloo")  # "nccl" on GPUs
torch.set_num_threads(1)
torch.manual_seed(0)  # the same initial weights on every rank
model, (x,) = transformer_stack(n_layer=2, d=64, seq=16, batch=4, dropout=0.1)
om = autoremat.optimize(model, "2.3MB", (x,), optimizer="adamw", world_size=dist.get_world_size())
ddp = DDP(om)
opt = torch.optim.AdamW(model.parameters())
for step in range(10):
    torch.manual_seed(1000 * step + dist.get_rank())  # each rank its own batch and dropout
    ddp(torch.randn_like(x)).backward()
    opt.step()
    opt.zero_grad()
if dist.get_rank() == 0:
    print(om.plan.summary())
dist.destroy_process_group()
