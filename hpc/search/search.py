"""Distributed architecture search over a pretrained supernet (``hpc search``).

Every rank loads the same pretrain checkpoint. Each generation's candidates (the same
list, in the same order, on every rank: :mod:`hpc.search.evolution`) are dealt out
round-robin; a rank scores its share *alone* — the pretrain's validation on the whole
validation set, after recalibrating the candidate's BatchNorm statistics from the same
fixed training images — and one ``all_gather_object`` brings every score to every
rank, merged by candidate index. A candidate's score is therefore the same computation
whichever rank runs it, so the search takes the same path and returns the same best
sub-network for any number of ranks.

Constraints: parameters are counted exactly on the standalone sub-network
(:func:`hpc.search.export.extract`). Latency (3 warm-ups, median of
``latency_repeats``, cached per sub-network) is measured on rank 0's device only when
``max_latency_ms`` is set — broadcast before the candidate is admitted, so every rank
takes the same decisions; latency varies between runs, so with a latency limit the
chosen sub-network can differ between *runs*, never between ranks of a run. Without a
limit latency is only reported, and each rank times the candidates it scores.

The global master checkpoints the search state (every evaluated sub-network with its
scores, the latency cache, the sub-networks found infeasible, the generation) after
every generation in ``OUT/checkpoints``; evolution's draws are a pure function of
``(seed, generation)``, so a resumed search continues exactly.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist
from torch import nn

import hpc
from hpc.checkpoint.files import checkpoint_path, load_latest, prune, save_atomic
from hpc.errors import CheckpointError
from hpc.pretrain.data import PretrainData
from hpc.pretrain.evaluate import validate
from hpc.pretrain.resume import set_determinism
from hpc.search.config import SEARCH_EXACTNESS_FIELDS, SearchConfig
from hpc.search.evolution import Arch, enumerate_archs, propose, rank_key, space_size
from hpc.search.export import count_params, extract
from hpc.search.trained import LoadedRun, load_run, measure_latency, recal_images
from hpc.sync.agree import any_true, broadcast_object
from hpc.track.tracker import Trackers, check_available, for_stage

__all__ = ["SearchResult", "search"]

logger = logging.getLogger(__name__)

#: Version of the search checkpoint layout.
FORMAT = 1


@dataclasses.dataclass
class SearchResult:
    """What :func:`search` returns (identical on every rank).

    Attributes:
        status: ``completed`` or ``stopped`` (stop request or ``max_generations``).
        mode: ``exhaustive`` or ``evolution``.
        best: The best sub-network: ``arch``, ``arch_name``, ``val_acc``, ``val_loss``,
            ``params``, ``latency_ms`` (``None`` while nothing was evaluated).
        records: Every evaluated sub-network, in evaluation order.
        generations: Generations done.
        space_size: Sub-networks in the space.
        world_size: Ranks of this run.
        wall_s: Seconds of search (over all resumes).
        out: The output directory.
    """

    status: str
    mode: str
    best: Optional[dict[str, Any]]
    records: list[dict[str, Any]]
    generations: int
    space_size: int
    world_size: int
    wall_s: float
    out: str


class _Search:
    """One search's fixed context and its state (records, caches, generation)."""

    def __init__(self, cfg: SearchConfig, run: LoadedRun) -> None:
        self.cfg, self.run, self.space = cfg, run, run.space
        info = hpc.info()
        self.rank, self.world, self.local_rank = info.rank, info.world_size, info.local_rank
        self.choices = list(self.space.choices())
        self.size = space_size(self.choices)
        self.mode = "exhaustive" if self.size <= cfg.budget else "evolution"
        self.recal_x = recal_images(run, cfg.recal_samples)
        x_val = run.data.x_val
        self.latency_x = x_val[:1].expand(cfg.latency_batch, *x_val.shape[1:]).contiguous()
        self.describe: Callable[[Any], str] = getattr(self.space, "describe", str)
        self.records: list[dict[str, Any]] = []
        self.infeasible: set[Arch] = set()
        self.latency: dict[Arch, float] = {}
        self.params: dict[Arch, int] = {}
        self.generation, self.wall_s = 0, 0.0
        self.trackers: Optional[Trackers] = None  # with the run's id, on every rank

    # -- constraints -------------------------------------------------------------
    def params_of(self, arch: Arch) -> int:
        if arch not in self.params:
            self.params[arch] = count_params(extract(self.space, arch))
        return self.params[arch]

    def measure(self, archs: list[Arch]) -> None:
        """Latency of the uncached ``archs``: rank 0 measures, every rank learns it."""
        missing = [a for a in archs if a not in self.latency]
        if not missing:
            return
        values = None
        if self.rank == 0:
            values = [measure_latency(extract(self.space, a), self.latency_x,
                                      self.cfg.latency_repeats) for a in missing]
        self.latency.update(zip(missing, broadcast_object(values)))

    def feasible(self, arch: Arch) -> bool:
        ok = self.cfg.max_params is None or self.params_of(arch) <= self.cfg.max_params
        if ok and self.cfg.max_latency_ms is not None:
            self.measure([arch])
            ok = self.latency[arch] <= self.cfg.max_latency_ms
        if not ok:
            self.infeasible.add(arch)
        return ok

    # -- candidates and scores ---------------------------------------------------
    def seen(self) -> set[Arch]:
        return {tuple(r["arch"]) for r in self.records} | self.infeasible

    def candidates(self) -> list[Arch]:
        """The next generation (empty when the search is over)."""
        cfg = self.cfg
        if self.mode == "exhaustive":
            seen, out = self.seen(), []
            for arch in enumerate_archs(self.choices):
                if len(out) == cfg.population:
                    break
                if arch not in seen and self.feasible(arch):
                    out.append(arch)
            return out
        left = cfg.budget - len(self.records)
        if left <= 0:
            return []
        parents = [tuple(r["arch"]) for r in sorted(self.records, key=rank_key)[:cfg.top_k]]
        return propose(min(cfg.population, left), self.generation, seed=cfg.seed,
                       choices=self.choices, sample=self.space.sample, parents=parents,
                       seen=self.seen(), feasible=self.feasible,
                       mutation_prob=cfg.mutation_prob)

    def candidates_left(self) -> bool:
        """False once the budget is spent (evolution) or every sub-network was seen."""
        if self.mode == "evolution":
            return len(self.records) < self.cfg.budget
        return len(self.seen()) < self.size

    def score(self, archs: list[Arch]) -> list[tuple[float, float]]:
        """(loss, accuracy) of each of ``archs``, each scored by one rank, gathered.

        Without a latency limit the scoring rank also times its candidates (latency is
        then only reported, so it may come from any rank); with one, latency was
        measured on rank 0 before the candidate was admitted.
        """
        data = self.run.data
        timed = self.cfg.max_latency_ms is None
        local = []
        for i in range(self.rank, len(archs), self.world):
            loss, acc = validate(self.space, data.x_val, data.y_val, [archs[i]],
                                 self.recal_x, reduce=False)
            ms = measure_latency(extract(self.space, archs[i]), self.latency_x,
                                 self.cfg.latency_repeats) if timed else None
            local.append((i, loss[0], acc[0], ms))
        parts: list[Any] = [local]
        if self.world > 1:
            parts = [None] * self.world
            dist.all_gather_object(parts, local)
        merged = {i: (loss, acc, ms) for part in parts for i, loss, acc, ms in part}
        if timed:
            self.latency.update((archs[i], merged[i][2]) for i in range(len(archs)))
        return [merged[i][:2] for i in range(len(archs))]

    def add(self, archs: list[Arch], scores: list[tuple[float, float]]) -> None:
        self.measure(archs)
        for arch, (loss, acc) in zip(archs, scores):
            self.records.append({
                "arch": list(arch), "arch_name": self.describe(arch), "val_acc": acc,
                "val_loss": loss, "params": self.params_of(arch),
                "latency_ms": self.latency[arch], "generation": self.generation})
        self.generation += 1

    # -- checkpoint --------------------------------------------------------------
    def state(self, done: bool) -> dict[str, Any]:
        return {"format": FORMAT, "step": self.generation, "done": done,
                "settings": _exactness(self.cfg), "config": self.cfg.to_dict(),
                "pretrain_checkpoint": self.run.checkpoint, "records": self.records,
                "infeasible": sorted(list(a) for a in self.infeasible),
                "latency": [[list(a), ms] for a, ms in sorted(self.latency.items())],
                "wall_s": self.wall_s, "mode": self.mode,
                "run_id": self.trackers.run_id if self.trackers else None}

    def load_state(self, payload: dict[str, Any]) -> None:
        self.records = list(payload["records"])
        self.infeasible = {tuple(a) for a in payload["infeasible"]}
        self.latency = {tuple(a): float(ms) for a, ms in payload["latency"]}
        self.generation, self.wall_s = int(payload["step"]), float(payload["wall_s"])

    def checkpoint(self, done: bool) -> None:
        if self.rank != 0:
            return
        directory = self.cfg.out_dir / "checkpoints"
        save_atomic(self.state(done), checkpoint_path(directory, self.generation))
        prune(directory, 2)
        if self.trackers is not None:  # after the checkpoint: a resume never replays it
            best = self.best() or {}
            self.trackers.send_rows([{"step": self.generation, "split": "search",
                                      "best_val_acc": best.get("val_acc"),
                                      "scored": len(self.records)}])

    def best(self) -> Optional[dict[str, Any]]:
        if not self.records:
            return None
        top = min(self.records, key=rank_key)
        return {k: top[k] for k in ("arch", "arch_name", "val_acc", "val_loss", "params",
                                    "latency_ms")}


def _exactness(cfg: SearchConfig) -> dict[str, Any]:
    values = {k: getattr(cfg, k) for k in SEARCH_EXACTNESS_FIELDS}
    values["run"] = str(Path(cfg.run).resolve())
    return values


def _resume_payload(cfg: SearchConfig) -> Optional[dict[str, Any]]:
    """On the master: the state to resume from (None = start), or raise."""
    directory = cfg.out_dir / "checkpoints"
    found = load_latest(directory, set_aside_skipped=True)  # our own: prune(2) follows
    if found is None:
        return None
    path, payload = found
    if cfg.resume == "never":
        raise CheckpointError(
            f"{directory} already holds a search checkpoint ({path.name}) and "
            "resume='never' would overwrite it.\n"
            "HINT: drop --no-resume to continue that search, or pass a new --out.")
    saved, now = payload.get("settings", {}), _exactness(cfg)
    changed = [f"{k}: {saved.get(k)!r} -> {now[k]!r}" for k in now if saved.get(k) != now[k]]
    if changed:
        raise CheckpointError(
            f"the search in {cfg.out_dir} was started with other settings "
            f"({'; '.join(changed)}), so continuing it would not be one search.\n"
            "HINT: rerun with the original settings, or pass a new --out.")
    return payload


def _restore(cfg: SearchConfig) -> Optional[dict[str, Any]]:
    """The resume state on every rank (collective), or raise the master's error on all."""
    payload, error = None, None
    if hpc.is_master():
        try:
            payload = _resume_payload(cfg)
        except CheckpointError as e:
            error = str(e)
    payload, error = broadcast_object((payload, error))
    if error is not None:
        raise CheckpointError(error)
    return payload


def _progress(ctx: _Search, total: int) -> Any:
    if not (ctx.cfg.progress and ctx.local_rank == 0):
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    import sys

    return tqdm(total=total, initial=len(ctx.records), desc=f"search ({ctx.mode})",
                unit="sub-net", file=sys.stderr, dynamic_ncols=True,
                mininterval=0.5 if sys.stderr.isatty() else 5.0)


def _planned(ctx: _Search) -> int:
    if ctx.mode == "evolution":
        return ctx.cfg.budget
    if ctx.cfg.max_params is None and ctx.cfg.max_latency_ms is None:
        return ctx.size
    return sum(ctx.params_of(a) <= (ctx.cfg.max_params or float("inf"))
               for a in enumerate_archs(ctx.choices))  # latency unknown before: an estimate


def _run_generations(ctx: _Search, stop_requested: Optional[Callable[[], bool]]) -> str:
    """Propose, score, record and checkpoint generations until done or asked to stop."""
    bar = _progress(ctx, _planned(ctx))
    try:
        while True:
            t0 = time.perf_counter()
            archs = ctx.candidates()
            if not archs:
                return "completed"
            ctx.add(archs, ctx.score(archs))
            ctx.wall_s += time.perf_counter() - t0
            done = not ctx.candidates_left()
            ctx.checkpoint(done)
            if bar is not None:
                bar.update(len(archs))
                bar.set_postfix(best=f"{ctx.best()['val_acc']:.4f}", refresh=False)
            logger.info("generation %d: %d sub-networks scored (%d in all), best %s "
                        "val acc %.4f", ctx.generation, len(archs), len(ctx.records),
                        ctx.best()["arch_name"], ctx.best()["val_acc"])
            if done:
                return "completed"
            local = bool(stop_requested()) if stop_requested is not None else False
            if any_true(local):
                logger.info("stopping after generation %d (stop requested)", ctx.generation)
                return "stopped"
            if ctx.cfg.max_generations is not None and \
                    ctx.generation >= ctx.cfg.max_generations:
                logger.info("stopping after generation %d (max_generations)",
                            ctx.generation)
                return "stopped"
    finally:
        if bar is not None:
            bar.close()


def search(config: Optional[SearchConfig] = None, space: Optional[nn.Module] = None,
           data: Optional[PretrainData] = None, *,
           stop_requested: Optional[Callable[[], bool]] = None) -> SearchResult:
    """Search a pretrained supernet for its best sub-network, on every rank (collective).

    Args:
        config: The search's settings (default :class:`SearchConfig`).
        space: The search space the run trained (default: the digits ``Supernet``); it
            needs ``sample``, ``forward``, ``choices`` and (unless a ``Supernet``)
            ``subnet``, see :mod:`hpc.pretrain.space`.
        data: The run's data (default: what the run's ``config.json`` names).
        stop_requested: Polled after every generation; True on any rank stops every
            rank after that generation's checkpoint (``status="stopped"``).

    Returns:
        A :class:`SearchResult`, identical on every rank; the global master has written
        ``OUT/search.json`` and ``OUT/pareto.png``.

    Raises:
        CheckpointError: the run has no loadable checkpoint, or the search's own
            checkpoint cannot be resumed with these settings.
        ValueError: invalid settings, or no sub-network satisfies the constraints.
    """
    from hpc.search.report import write_outputs

    cfg = config or SearchConfig()
    cfg.validate()
    check_available(cfg.tensorboard, cfg.wandb, cfg.mlflow)  # every rank, before init
    hpc.init_torch(seed=cfg.seed)
    set_determinism(True)  # cuDNN: a candidate's score must not depend on the rank's kernels
    payload = _restore(cfg)
    run = load_run(cfg.run, payload["pretrain_checkpoint"] if payload else None, space, data)
    ctx = _Search(cfg, run)
    if payload is not None:
        ctx.load_state(payload)
        logger.info("resuming the search in %s after generation %d (%d sub-networks "
                    "scored)", cfg.out_dir, ctx.generation, len(ctx.records))
    ctx.trackers = for_stage(
        cfg.out_dir, cfg, resume_step=ctx.generation if payload is not None else None,
        known_id=payload.get("run_id") if payload is not None else None, config=cfg.to_dict())
    logger.info("searching %s (step %d): %d sub-networks, %s, budget %d, %d ranks",
                run.checkpoint, run.step, ctx.size, ctx.mode, cfg.budget, ctx.world)
    status = "completed" if payload is not None and payload["done"] else \
        _run_generations(ctx, stop_requested)
    if ctx.trackers is not None:
        ctx.trackers.close(status)
    best = ctx.best()
    if best is None:
        raise ValueError(_infeasible_message(ctx))
    result = SearchResult(status=status, mode=ctx.mode, best=best, records=ctx.records,
                          generations=ctx.generation, space_size=ctx.size,
                          world_size=ctx.world, wall_s=ctx.wall_s, out=str(cfg.out_dir))
    if ctx.rank == 0:
        write_outputs(result, cfg, run)
    hpc.barrier()  # search.json exists on return, on every rank (hpc tune may follow)
    logger.info("search %s: best %s val acc %.4f, %d params, %.3f ms; %d sub-networks "
                "in %.1f s on %d ranks", status, best["arch_name"], best["val_acc"],
                best["params"], best["latency_ms"], len(ctx.records), ctx.wall_s, ctx.world)
    return result


def _infeasible_message(ctx: _Search) -> str:
    cfg = ctx.cfg
    smallest = min(ctx.params.values()) if ctx.params else None
    fastest = min(ctx.latency.values()) if ctx.latency else None
    return (f"no sub-network satisfies the constraints (max_params={cfg.max_params}, "
            f"max_latency_ms={cfg.max_latency_ms}): the smallest of the "
            f"{len(ctx.infeasible)} tried has {smallest} parameters"
            + (f", the fastest {fastest:.3f} ms" if fastest is not None else "") + ".\n"
            "HINT: raise --max-params / --max-latency-ms, or drop them.")
