"""Hugging Face Accelerate on hpc's bootstrap: any launcher, preemptible, exact resume.

``accelerate launch`` is not needed. Start the script with ``srun``, ``mpirun``,
``torchrun`` or ``hpc run``, like every other script. :func:`hpc.init_torch` runs the
pre-flight, exports ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT``
and initializes the process group. ``Accelerator()`` then finds the group up and uses it.

Checkpoints are hpc's: ``save_checkpoint`` unwraps the model Accelerate prepared, and
``restore_checkpoint`` loads with ``weights_only=True``. With :class:`hpc.AgreedStop` and
a :class:`hpc.ResumableSampler`, a stopped run resumes bitwise::

    hpc run --nproc 2 -- python docs/examples/train_accelerate.py --out runs/acc
    srun -N2 --ntasks-per-node=2 python docs/examples/train_accelerate.py --out runs/acc
    mpirun -np 4 python docs/examples/train_accelerate.py --out runs/acc

See ``docs/integrations.md``.
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

import hpc

stop = hpc.AgreedStop()  # first: a signal while torch still imports must not kill us

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()

    # [setup]
    info = hpc.init_torch(seed=0)            # pre-flight, env exported, process group up
    hpc.setup_logging(info)
    accelerator = Accelerator(cpu=hpc.device().type == "cpu")
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt = accelerator.prepare(model, opt)  # DDP over hpc's process group
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 32, generator=g)
    data = TensorDataset(x, (x @ torch.randn(32, 10, generator=g)).argmax(1))
    sampler = hpc.ResumableSampler(data, batch_size=32, seed=0)
    loader = DataLoader(data, batch_size=32, sampler=sampler, drop_last=True,
                        generator=torch.Generator())
    steps_per_epoch = len(loader)
    # [/setup]

    # [resume]
    ckpt = args.out / "checkpoints"
    states = dict(model=model, optimizer=opt, sampler=sampler)
    restored = hpc.restore_checkpoint(ckpt, **states)
    step, start = (restored.step, restored.epoch) if restored else (0, 0)
    rid = hpc.run_id(args.out)
    # [/resume]

    # [loop]
    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        for batch, (xb, yb) in enumerate(loader, start=sampler.start_batch):
            xb, yb = xb.to(accelerator.device), yb.to(accelerator.device)
            loss = nn.functional.cross_entropy(model(xb), yb)
            opt.zero_grad(set_to_none=True)
            accelerator.backward(loss)
            opt.step()
            step += 1
            if stop(step):                   # True on every rank at the same step
                at = (epoch, batch + 1) if batch + 1 < steps_per_epoch else (epoch + 1, 0)
                path = hpc.save_checkpoint(ckpt, step, **states, epoch=at[0], batch=at[1])
                stop.requeue_and_exit(step, path)
    print(f"rank {info.rank}: accelerate {accelerator.num_processes} processes, index "
          f"{accelerator.process_index} local {accelerator.local_process_index} "
          f"({accelerator.distributed_type}); done step {step} digest "
          f"{digest(accelerator.unwrap_model(model))} run {rid}", flush=True)
    # [/loop]
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
