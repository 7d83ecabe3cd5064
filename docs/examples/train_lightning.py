"""A Lightning Trainer fit on hpc's bootstrap, preemptible, under one run id.

The same script under every launcher hpc reads; a stop signal (Slurm's warning signal,
a preemption's SIGTERM, ``kill -USR2`` to any rank) stops every rank after the same
batch with a checkpoint, the job is requeued, and the next attempt resumes from it
under the same run id (its TensorBoard version)::

    hpc run --nproc 2 -- python docs/examples/train_lightning.py --out runs/lit
    sbatch --requeue slurm/pretrain.sbatch python docs/examples/train_lightning.py --out runs/lit

``tests/integration/test_docs_examples.py`` runs it under ``hpc run --nproc 2`` with a
USR2 to one rank and a resume; ``tests/integration/test_integrations.py`` under sbatch
with a real partition preemption. See ``docs/integrations.md``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import hpc

stop = hpc.AgreedStop()  # first: a signal while torch still imports must not kill us

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.loggers import TensorBoardLogger  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from hpc.integrations.lightning import HPCEnvironment, HPCPreemption  # noqa: E402


class Classifier(L.LightningModule):
    """An MLP with BatchNorm and dropout; Lightning's DDP synchronizes it."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(),
                                 nn.Dropout(0.1), nn.Linear(64, 10))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 32, generator=g)
    y = (x @ torch.randn(32, 10, generator=g)).argmax(1)
    return DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True,
                      generator=torch.Generator().manual_seed(0))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()

    # [setup]
    env = HPCEnvironment(seed=0)             # hpc.init_torch(): pre-flight, process group
    hpc.setup_logging(env.info)
    rid = hpc.run_id(args.out)               # the same id after every requeue
    preemption = HPCPreemption(args.out / "checkpoints", stop, every_n_steps=20)
    trainer = L.Trainer(**env.trainer_kwargs(), max_epochs=args.epochs,
                        callbacks=[preemption], log_every_n_steps=1,
                        logger=TensorBoardLogger(args.out, name="tensorboard", version=rid),
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(Classifier(), loader(), ckpt_path=preemption.resume_path(), weights_only=True)
    preemption.exit_if_stopped()             # 75 requeued, 0 not a Slurm job, 1 failed
    # [/setup]
    info = hpc.info()
    print(f"rank {info.rank}: layout {trainer.world_size} ranks, {trainer.num_nodes} nodes, "
          f"global_rank {trainer.global_rank} local_rank {trainer.local_rank} node_rank "
          f"{trainer.node_rank}; done step {trainer.global_step} run {rid}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
