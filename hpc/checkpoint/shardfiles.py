"""Sharded checkpoint directories: layout, manifest, verification, listing, removal.

The directory layer under :mod:`hpc.checkpoint.sharded` (the collective save and load),
as :mod:`hpc.checkpoint.files` is under :mod:`hpc.checkpoint.resume`; no collectives and
no process group here. A sharded checkpoint is a directory ``ckpt-<step:08d>.dcp/`` in
PyTorch's distributed-checkpoint (DCP) layout plus two files of ours::

    .metadata            DCP's index (written last by DCP's coordinator, rank 0)
    __<rank>_<n>.distcp  the tensors each rank wrote
    hpc-meta.pt          the master's non-tensor part (torch.save, loaded weights_only=True)
    hpc-manifest.json    size and SHA-256 of every other file, the step, the format

DCP marks a checkpoint complete only by ``.metadata`` and keeps no checksums, and a save
killed after the data but before ``.metadata`` in a directory that held one gives a
wrong mix. So a save writes into a fresh hidden directory
``.ckpt-<step>.dcp.tmp-<host>-<pid>`` (:func:`temp_dir`, the master's name), and
:func:`put_in_place` writes the manifest there (atomically, fsynced), fsyncs it and renames
the directory into place. A checkpoint is complete when :func:`verify_sharded` passes.
Removals rename first (``.ckpt-<step>.dcp.del-<host>-<pid>``), then delete, so a crash
never leaves half a checkpoint under its name; :func:`remove_stale_dirs` deletes what a
killed save or removal left.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import time
from pathlib import Path
from typing import Any, Union

from hpc.checkpoint.files import STALE_TMP_S, fsync_dir, pid_alive, sha256_file
from hpc.errors import CheckpointError

__all__ = ["sharded_path", "is_sharded", "list_sharded", "verify_sharded", "remove_stale_dirs",
           "prune_sharded", "temp_dir", "shard_digests", "put_in_place", "MANIFEST",
           "META", "DCP_METADATA", "SHARDED_FORMAT"]

logger = logging.getLogger(__name__)

#: Version of the sharded layout (the manifest's ``"format"``).
SHARDED_FORMAT = 1
#: The manifest: every other file's size and SHA-256, the step, the format.
MANIFEST = "hpc-manifest.json"
#: The master's non-tensor part (:mod:`hpc.checkpoint.sharded`).
META = "hpc-meta.pt"
#: DCP's index file.
DCP_METADATA = ".metadata"
_NAME = re.compile(r"^ckpt-(\d{8,})\.dcp$")
#: ``.ckpt-<step>.dcp.tmp-<host>-<pid>`` (a save) or ``.del-`` (a checkpoint being removed)
_TEMP = re.compile(r"^\.ckpt-\d{8,}\.dcp\.(?:tmp|del)-(?P<host>.+)-(?P<pid>\d+)$")
#: A shard file's size and SHA-256, by name.
Digests = dict[str, tuple[int, str]]
PathLike = Union[str, Path]


def sharded_path(directory: PathLike, step: int) -> Path:
    """The directory of the sharded checkpoint taken after global step ``step``."""
    return Path(directory) / f"ckpt-{step:08d}.dcp"


def is_sharded(path: PathLike) -> bool:
    """Whether ``path`` names a sharded checkpoint (by its name: ``ckpt-<step>.dcp``)."""
    return bool(_NAME.match(Path(path).name))


def list_sharded(directory: PathLike) -> list[Path]:
    """Sharded checkpoints in ``directory``, oldest (lowest step) first; by name only
    (:func:`verify_sharded` checks one)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir()
             if (m := _NAME.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def _own(kind: str, path: Path) -> Path:
    """``path``'s hidden sibling owned by this process: ``.<name>.<kind>-<host>-<pid>``."""
    return path.with_name(f".{path.name}.{kind}-{socket.gethostname()}-{os.getpid()}")


def temp_dir(final: Path) -> Path:
    """The hidden directory this process (the master) saves ``final`` into."""
    return _own("tmp", final)


def _newest_mtime(path: Path) -> float:
    times = [path.stat().st_mtime]
    for entry in path.iterdir():
        try:
            times.append(entry.stat().st_mtime)
        except FileNotFoundError:
            continue
    return max(times)


def remove_stale_dirs(directory: PathLike) -> list[Path]:
    """Delete hidden directories of sharded saves (or removals) that did not finish.

    Stale: owned by this process (saves here are blocking, so none of its own is in
    flight when the next one starts), or by a process of this host that is gone, or
    untouched for :data:`~hpc.checkpoint.files.STALE_TMP_S` (an owner on another node
    cannot be asked). Other entries of ``directory`` are never touched.
    """
    removed, now, host = [], time.time(), socket.gethostname()
    try:
        entries = list(Path(directory).iterdir())
    except FileNotFoundError:
        return []
    for path in entries:
        m = _TEMP.match(path.name)
        if not m or not path.is_dir():
            continue
        pid = int(m.group("pid"))
        try:
            stale = (m.group("host") == host and (pid == os.getpid() or not pid_alive(pid))
                     or now - _newest_mtime(path) > STALE_TMP_S)
        except FileNotFoundError:  # its owner renamed or removed it meanwhile
            continue
        if stale:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
            logger.info("removed %s, an unfinished sharded save or removal of pid %d on %s",
                        path.name, pid, m.group("host"))
    return removed


def _remove(path: Path) -> None:
    """Rename ``path`` out of the listing first, then delete it: a crash midway leaves
    a hidden directory the next save removes, never half a checkpoint under its name."""
    trash = _own("del", path)
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def prune_sharded(directory: PathLike, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` sharded checkpoints (0: none); return them."""
    old = list_sharded(directory)[:-keep] if keep > 0 else []
    for path in old:
        _remove(path)
    return old


def _broken(path: Path, what: str) -> CheckpointError:
    return CheckpointError(
        f"sharded checkpoint {path} is incomplete or corrupt: {what}.\n"
        "A save that was killed, a disk that filled up or a file changed afterwards "
        "leaves a checkpoint that does not match its manifest (written last).\n"
        "HINT: delete it to resume from the previous checkpoint.")


def _read_manifest(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise CheckpointError(f"sharded checkpoint {path} does not exist or is not a "
                              "directory.\nHINT: pass a ckpt-<step>.dcp directory "
                              "(list_sharded lists a checkpoint directory's).")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files, fmt = manifest["files"], int(manifest["format"])
    except FileNotFoundError:
        raise _broken(path, f"{MANIFEST} is missing") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise _broken(path, f"{MANIFEST} does not parse ({type(e).__name__}: {e})") from e
    if fmt > SHARDED_FORMAT:
        raise CheckpointError(
            f"sharded checkpoint {path} has format {fmt}; this torch-hpc reads up to "
            f"{SHARDED_FORMAT}.\nIt was written by a newer torch-hpc.\n"
            "HINT: upgrade torch-hpc where you resume.")
    for name in (DCP_METADATA, META):
        if name not in files:
            raise _broken(path, f"{MANIFEST} lists no {name}")
    return manifest


def verify_sharded(path: PathLike) -> None:
    """Check a sharded checkpoint's files against its manifest (no collectives).

    Raises:
        CheckpointError: the manifest, ``.metadata``, ``hpc-meta.pt`` or a shard is
            missing, a file is shorter/longer than recorded or its SHA-256 differs, or
            ``.metadata`` names a file the manifest does not list. The message names it.
    """
    path = Path(path)
    files = _read_manifest(path)["files"]
    for name, entry in sorted(files.items()):
        file = path / name
        try:
            size = file.stat().st_size
        except FileNotFoundError:
            raise _broken(path, f"{name} is missing ({entry['size']} bytes in "
                                f"{MANIFEST})") from None
        if size != entry["size"]:
            raise _broken(path, f"{name} has {size} bytes, {MANIFEST} records "
                                f"{entry['size']}")
        actual = sha256_file(file)
        if actual != entry["sha256"]:
            raise _broken(path, f"{name} has SHA-256 {actual[:16]}..., {MANIFEST} records "
                                f"{entry['sha256'][:16]}...")
    from torch.distributed.checkpoint import FileSystemReader

    named = {info.relative_path for info in
             FileSystemReader(str(path)).read_metadata().storage_data.values()}
    unlisted = sorted(named - set(files))
    if unlisted:
        raise _broken(path, f".metadata names {unlisted}, which {MANIFEST} does not list")


def shard_digests(tmp: Path, rank: int) -> Digests:
    """name -> (bytes, SHA-256) of the shard files rank ``rank`` wrote into ``tmp``."""
    return {p.name: (p.stat().st_size, sha256_file(p))
            for p in sorted(tmp.glob(f"__{rank}_*.distcp"))}


def _manifest(tmp: Path, step: int, shards: list[Digests], named: set[str]
              ) -> dict[str, Any]:
    """The manifest of ``tmp``, after checking that rank 0 sees every rank's files."""
    files = {name: {"size": size, "sha256": digest, "rank": rank}
             for rank, own in enumerate(shards) for name, (size, digest) in own.items()}
    for name in (DCP_METADATA, META):
        files[name] = {"size": (tmp / name).stat().st_size,
                       "sha256": sha256_file(tmp / name), "rank": 0}
    unseen = [f"{name} of rank {e['rank']}" for name, e in sorted(files.items())
              if not (tmp / name).is_file() or (tmp / name).stat().st_size != e["size"]]
    unseen += [f"{name} (in .metadata)" for name in sorted(named - set(files))]
    if unseen:
        raise CheckpointError(
            f"rank 0 does not see {', '.join(unseen)} in {tmp} as written.\n"
            "The ranks do not share the checkpoint directory (node-local storage).\n"
            "HINT: put the checkpoint directory on a filesystem every node mounts.")
    return {"format": SHARDED_FORMAT, "step": int(step), "world_size": len(shards),
            "files": files}


def put_in_place(tmp: Path, final: Path, step: int, shards: list[Digests],
                 named: set[str]) -> None:
    """Write the manifest of ``tmp`` (``shards``: each rank's :func:`shard_digests`;
    ``named``: the files DCP's ``.metadata`` names) and rename ``tmp`` to ``final``, both
    fsynced. A checkpoint already at ``final`` (the same step saved again) is replaced.

    Raises:
        CheckpointError: rank 0 does not see a file a rank wrote (no shared directory).
        OSError: writing or renaming failed (disk full, permissions).
    """
    manifest = _manifest(tmp, step, shards, named)
    part = tmp / f".{MANIFEST}.tmp"
    with open(part, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, tmp / MANIFEST)
    fsync_dir(tmp)
    old = _own("del", final) if final.exists() else None
    if old is not None:
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
