"""A Lightning Fabric loop on hpc's bootstrap: preemptible, exact resume, one run id.

Fabric runs on the process group :class:`~hpc.integrations.lightning.HPCEnvironment`
made (pre-flight, master rules); hpc's :class:`~hpc.AgreedStop` stops every rank after
the same step; Fabric saves; the job is requeued; the next attempt loads with
``weights_only=True`` and :class:`~hpc.ResumableSampler` continues mid-epoch, so the
final weights equal an uninterrupted run's::

    hpc run --nproc 2 -- python docs/examples/train_fabric.py --out runs/fabric
    sbatch --requeue slurm/pretrain.sbatch python docs/examples/train_fabric.py --out runs/fabric

Tested under ``hpc run --nproc 2`` (USR2 to one rank, then a resume) and on 2 nodes of
the test cluster (``tests/integration/test_integrations.py``). See ``docs/integrations.md``.
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

import hpc

stop = hpc.AgreedStop()  # first: a signal while torch still imports must not kill us

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from hpc.integrations.lightning import HPCEnvironment  # noqa: E402


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
    env = HPCEnvironment(seed=0)
    hpc.setup_logging(env.info)
    fabric = L.Fabric(**env.trainer_kwargs())
    fabric.launch()                          # the launcher started the ranks: no spawn
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt = fabric.setup(model, opt)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 32, generator=g)
    data = TensorDataset(x, (x @ torch.randn(32, 10, generator=g)).argmax(1))
    sampler = hpc.ResumableSampler(data, batch_size=32, seed=0)
    # Not fabric.setup_dataloaders: its loader sets the sampler's epoch to its own count
    # of iterations, which starts again at 0 in a resumed attempt.
    loader = DataLoader(data, batch_size=32, sampler=sampler, drop_last=True,
                        generator=torch.Generator())
    steps_per_epoch = len(loader)            # before a resume shortens the first epoch
    # [/setup]

    # [resume]
    ckpt = args.out / "checkpoints" / "fabric.ckpt"
    state = {"model": model, "optimizer": opt, "step": 0, "epoch": 0, "batch": 0}
    if ckpt.exists():                        # every rank loads; weights_only: no pickles
        state.update(fabric.load(ckpt, state, weights_only=True))
        sampler.resume_at(state["epoch"], state["batch"])
    rid = hpc.run_id(args.out)               # the same id after every requeue
    # [/resume]

    # [loop]
    step = state["step"]
    for epoch in range(state["epoch"], args.epochs):
        sampler.set_epoch(epoch)             # keeps a resumed epoch's skip
        for batch, (xb, yb) in enumerate(loader, start=sampler.start_batch):
            xb, yb = fabric.to_device((xb, yb))
            loss = nn.functional.cross_entropy(model(xb), yb)
            opt.zero_grad(set_to_none=True)
            fabric.backward(loss)
            opt.step()
            step += 1
            if stop(step):                   # True on every rank at the same step
                at = (epoch, batch + 1) if batch + 1 < steps_per_epoch else (epoch + 1, 0)
                state.update(step=step, epoch=at[0], batch=at[1])
                fabric.save(ckpt, state)     # rank 0 writes
                stop.requeue_and_exit(step, str(ckpt))
    print(f"rank {fabric.global_rank}: layout {fabric.world_size} ranks, local_rank "
          f"{fabric.local_rank} node_rank {fabric.node_rank}; done step {step} digest "
          f"{digest(model)} "
          f"run {rid}", flush=True)
    # [/loop]
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
