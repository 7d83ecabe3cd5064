"""Lightning (Fabric and Trainer) on torch-hpc's bootstrap and its agreed stop.

:class:`HPCEnvironment` is a Lightning ``ClusterEnvironment`` whose layout comes from
:func:`hpc.detect` under every launcher hpc reads (Slurm, torchrun, Open MPI, MPICH,
PALS, Flux, LSF, ``hpc run``). It runs :func:`hpc.init_torch` first: the pre-flight,
the master rules and the process group. Lightning then finds the group up and uses it.
A Trainer or Fabric whose ``devices``/``num_nodes`` disagree with what the launcher
started is refused with both sides named, instead of training a wrong layout.

:class:`HPCPreemption` is a Trainer callback. It asks :class:`hpc.AgreedStop` after every
training batch, so a signal to any rank (Slurm's warning signal, or a preemption's
SIGTERM) stops every rank after the same batch. The stop writes a Lightning checkpoint
(as do every ``every_n_steps`` steps and the end of training), and
:meth:`HPCPreemption.exit_if_stopped` then requeues the Slurm job (exit 75) as
``hpc pretrain`` does. The next attempt resumes with
``trainer.fit(..., ckpt_path=preemption.resume_path())``.

Lightning's own Slurm support is left out: its auto-requeue handles SIGUSR1 only
(Lightning#20542), and its environment trusts ``SLURM_*`` without a pre-flight. The
module imports ``lightning``; ``import hpc`` does not import it.
"""

from __future__ import annotations

import logging
import os
import signal
import warnings
from pathlib import Path
from typing import Any, Optional, Union

import hpc
from hpc.errors import LaunchEnvironmentError

try:
    from lightning.fabric.plugins.environments import ClusterEnvironment
    from lightning.pytorch.callbacks import Callback
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError(
        f"hpc.integrations.lightning needs the 'lightning' package ({e}).\n"
        "HINT: pip install 'torch-hpc[lightning]'") from e

__all__ = ["HPCEnvironment", "HPCPreemption"]

logger = logging.getLogger(__name__)


class HPCEnvironment(ClusterEnvironment):
    """The launch hpc detected, as a Lightning cluster environment.

    Args:
        init: Run :func:`hpc.init_torch` now (default): the pre-flight, the master
            rules, the GPU binding and the process group that Lightning then uses.
            ``False`` only reads the layout (:func:`hpc.info`), and Lightning makes the
            group itself.
        info: Report this layout instead (no init), e.g. ``hpc.detect(environ)``.
        **init_kwargs: Passed to :func:`hpc.init_torch` (``backend``, ``seed``,
            ``timeout``, ...).

    Example::

        env = HPCEnvironment(seed=0)
        trainer = L.Trainer(**env.trainer_kwargs(), max_epochs=10)
    """

    def __init__(self, *, init: bool = True, info: Optional[hpc.DistInfo] = None,
                 **init_kwargs: Any) -> None:
        super().__init__()
        if info is None:
            info = hpc.init_torch(**init_kwargs) if init else hpc.info()
        self._info = info
        # Lightning hints "srun is available but not used" wherever srun is installed;
        # hpc found this launch's launcher, so the hint (a guess) would only mislead.
        warnings.filterwarnings("ignore", message="The `srun` command is available")

    @property
    def info(self) -> Any:
        """The :class:`hpc.DistInfo` this environment reports."""
        return self._info

    @property
    def creates_processes_externally(self) -> bool:
        return True  # the launcher started every rank: Lightning must not spawn

    @property
    def main_address(self) -> str:
        return os.environ.get("MASTER_ADDR") or self._info.master_addr or "127.0.0.1"

    @property
    def main_port(self) -> int:
        port = os.environ.get("MASTER_PORT") or self._info.master_port
        if port is None:
            raise LaunchEnvironmentError(
                f"the {self._info.launcher} launch names no master port and hpc.init_torch "
                "has not run.\nHINT: construct HPCEnvironment() with init=True (the "
                "default), or export MASTER_PORT.")
        return int(port)

    @staticmethod
    def detect() -> bool:
        """True when hpc finds a launcher (not the single-process fallback)."""
        return hpc.detect().launcher != "local"

    def world_size(self) -> int:
        return self._info.world_size

    def set_world_size(self, size: int) -> None:
        if size != self._info.world_size:
            raise LaunchEnvironmentError(self._mismatch(
                f"Lightning computed a world size of {size} (num_nodes x devices)"))

    def global_rank(self) -> int:
        return self._info.rank

    def set_global_rank(self, rank: int) -> None:
        if rank != self._info.rank:
            raise LaunchEnvironmentError(self._mismatch(
                f"Lightning numbers global rank {self._info.rank} as {rank} (node_rank x "
                "devices + local_rank: ranks numbered node by node)"))

    def local_rank(self) -> int:
        return self._info.local_rank

    def node_rank(self) -> int:
        return self._info.node_rank

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        info = self._info
        if info.local_world_size * info.num_nodes != info.world_size:
            raise LaunchEnvironmentError(
                f"the {info.launcher} launch has {info.world_size} ranks on {info.num_nodes} "
                f"nodes, not the same number on every node (this node: "
                f"{info.local_world_size}); Lightning needs the same devices per node.\n"
                "HINT: launch the same number of tasks per node (srun "
                "--ntasks-per-node, mpirun --map-by ppr:N:node).")
        if (num_devices, num_nodes) != (info.local_world_size, info.num_nodes):
            raise LaunchEnvironmentError(self._mismatch(
                f"Trainer/Fabric(devices={num_devices}, num_nodes={num_nodes})"))

    def trainer_kwargs(self) -> dict[str, Any]:
        """``accelerator``, ``devices``, ``num_nodes``, ``strategy`` and ``plugins`` for
        ``L.Trainer(...)`` or ``L.Fabric(...)`` that match the launch."""
        accelerator = "gpu" if hpc.device().type == "cuda" else "cpu"
        info = self._info
        return {"accelerator": accelerator, "devices": info.local_world_size,
                "num_nodes": info.num_nodes,
                "strategy": "ddp" if info.world_size > 1 else "auto", "plugins": [self]}

    def _mismatch(self, fact: str) -> str:
        info = self._info
        nodes = f"{info.num_nodes} node" + ("s" if info.num_nodes != 1 else "")
        return (f"{fact}, but the {info.launcher} launch started {info.world_size} ranks on "
                f"{nodes} ({info.local_world_size} per node, this is rank "
                f"{info.rank}): Lightning would number the ranks wrong.\nHINT: pass "
                f"**env.trainer_kwargs() (devices={info.local_world_size}, num_nodes="
                f"{info.num_nodes}); with srun, keep the default --distribution=block.")


class HPCPreemption(Callback):
    """Stop every rank after the same batch on a signal, checkpoint, requeue.

    Checkpoints (``hpc-<step>.ckpt``, the Trainer's full state) are written at a stop,
    every ``every_n_steps`` steps and at the end of training, so :meth:`resume_path`
    continues a stopped run, a crashed one from its last periodic checkpoint, and a
    finished one without training again. On a resume, the Trainer's ``TensorBoardLogger``
    writers open with ``purge_step`` at the step the run resumes at, so the steps a crashed
    attempt logged after its checkpoint show once, as the rerun logs them.

    Args:
        dirpath: Where the checkpoints go, on a filesystem every node sees.
        stop: The :class:`hpc.AgreedStop` (create it first thing in the script, so
            a signal during imports is not lost); default: one created here.
        every_n_steps: Also checkpoint every N optimizer steps (0: only at stops and at
            the end). After a crash the run repeats at most N steps.
        keep: Checkpoints kept (the newest).

    Example::

        preemption = HPCPreemption(out / "checkpoints", stop, every_n_steps=100)
        trainer = L.Trainer(**env.trainer_kwargs(), callbacks=[preemption])
        trainer.fit(model, loader, ckpt_path=preemption.resume_path(), weights_only=True)
        preemption.exit_if_stopped()  # 75 requeued, 0 not Slurm, 1 not requeued
    """

    def __init__(self, dirpath: Union[str, Path], stop: Optional[Any] = None, *,
                 every_n_steps: int = 0, keep: int = 2) -> None:
        super().__init__()
        if every_n_steps < 0 or keep < 1:
            raise ValueError(f"HPCPreemption: every_n_steps={every_n_steps} must be >= 0 "
                             f"and keep={keep} >= 1.")
        self.dirpath = Path(dirpath)
        self.stop = stop if stop is not None else hpc.AgreedStop()
        self.every_n_steps, self.keep = every_n_steps, keep
        self.stopped_at: Optional[tuple[int, str]] = None
        self._saved_step: Optional[int] = None
        self._sigterm = signal.getsignal(signal.SIGTERM)  # the guard's, installed by stop

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """Give SIGTERM back to hpc's guard. Lightning (2.x) sets its own handler at fit
        start: it broadcasts from inside the signal handler and, at the end of the batch,
        raises ``SIGTERMException``, a ``SystemExit`` with status 0, so a preempted job
        ends as if it had completed and is never requeued. hpc's guard only records the
        signal; the agreed stop, the checkpoint and the requeue follow at the step's end.
        Lightning puts the handlers back as they were when ``fit`` returns."""
        if callable(self._sigterm):
            signal.signal(signal.SIGTERM, self._sigterm)

    def _save(self, trainer: Any, step: int) -> str:
        """Checkpoint ``step`` (every rank calls it; rank 0 writes and prunes)."""
        path = self.dirpath / f"hpc-{step:08d}.ckpt"
        trainer.save_checkpoint(str(path), weights_only=False)
        if trainer.is_global_zero:
            for old in sorted(self.dirpath.glob("hpc-*.ckpt"))[:-self.keep]:
                old.unlink(missing_ok=True)
        trainer.strategy.barrier("hpc-checkpoint")
        self._saved_step = step
        return str(path)

    def on_load_checkpoint(self, trainer: Any, pl_module: Any,
                           checkpoint: dict[str, Any]) -> None:
        """A resume: the Trainer's TensorBoard loggers drop, from the step the run resumes
        at, what an earlier attempt logged there (a crashed run's steps since its last
        checkpoint run again; TensorBoard would show them twice)."""
        step = _next_logged_step(checkpoint)
        if step is not None:
            for each in trainer.loggers:
                _purge_tensorboard_from(each, step)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if self.stopped_at is not None:
            return
        if self.stop(step):
            self.stopped_at = (step, self._save(trainer, step))
            trainer.should_stop = True
            logger.info("stopping after step %d on %s; checkpoint %s", step,
                        self.stop.signal_name, self.stopped_at[1])
        elif self.every_n_steps and step % self.every_n_steps == 0 and \
                step != self._saved_step:
            self._save(trainer, step)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.stopped_at is None and trainer.global_step != self._saved_step:
            self._save(trainer, trainer.global_step)  # a rerun finds the run finished

    def resume_path(self) -> Optional[str]:
        """The newest checkpoint in ``dirpath`` (``None``: a fresh start)."""
        found = sorted(self.dirpath.glob("hpc-*.ckpt"))
        return str(found[-1]) if found else None

    def exit_if_stopped(self) -> None:
        """After ``fit``: when a signal stopped it, requeue the Slurm job and exit (75
        requeued, 0 not a Slurm job, 1 not requeued); otherwise return (collective)."""
        if self.stopped_at is not None:
            self.stop.requeue_and_exit(*self.stopped_at)


def _next_logged_step(checkpoint: dict[str, Any]) -> Optional[int]:
    """The step at which the resumed fit logs first (pure): the checkpoint's batches that
    stepped, plus the one Lightning adds when it restarts; None if the checkpoint lacks it."""
    loop = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_loop.state_dict", {})
    stepped = loop.get("_batches_that_stepped")
    return None if stepped is None else int(stepped) + 1


def _purge_tensorboard_from(logger_: Any, step: int) -> None:
    """Open ``logger_``'s writer, if it is Lightning's ``TensorBoardLogger``, with
    ``purge_step=step``: TensorBoard then hides what earlier writers logged at ``step``
    or later. A writer already open (a strategy that restores after setup) is closed, and
    the next log opens a new one. Nothing for other loggers, or a ``purge_step`` the
    user set."""
    from lightning.pytorch.loggers import TensorBoardLogger

    kwargs = getattr(logger_, "_kwargs", None)
    if not isinstance(logger_, TensorBoardLogger) or not isinstance(kwargs, dict) or \
            "purge_step" in kwargs:
        return
    kwargs["purge_step"] = step
    if getattr(logger_, "_experiment", None) is not None:
        logger_._experiment.close()
        logger_._experiment = None
