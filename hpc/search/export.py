"""A searched sub-network as a standalone ``nn.Module``, and its ``model.pt`` file.

:func:`extract` copies exactly the operations an architecture uses out of a
:class:`~hpc.pretrain.space.Supernet` (stem, the chosen candidate of each block, head —
with their BatchNorm statistics) into a :class:`SubNet`, whose forward is the supernet's
forward for that architecture, operation for operation, so its outputs are bitwise
those of the supernet on the CPU. Its parameter count is the sub-network's exact size.

``model.pt`` (written by :func:`save_model`) holds the state_dict, the architecture and
the constructor arguments; :func:`load_model` rebuilds the module from them, without the
supernet, reading with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Union

import torch
from torch import Tensor, nn

from hpc.checkpoint.files import save_atomic
from hpc.pretrain.space import CANDIDATES, Supernet, build_op, check_ops

__all__ = ["SubNet", "count_params", "extract", "load_model", "save_model"]

#: Version of the ``model.pt`` layout.
MODEL_FORMAT = 1


class SubNet(nn.Module):
    """One sub-network of the default :class:`~hpc.pretrain.space.Supernet`, standalone.

    Args:
        arch: One candidate index per block.
        in_channels: Channels of the input images.
        num_classes: Number of classes.
        width: Channels of every block.
        ops: The supernet's candidate operations (what each index of ``arch`` names).
    """

    def __init__(self, arch: Sequence[int], in_channels: int = 1, num_classes: int = 10,
                 width: int = 32, ops: Sequence[str] = CANDIDATES) -> None:
        super().__init__()
        arch = tuple(int(a) for a in arch)
        ops = check_ops(ops)
        bad = [a for a in arch if not 0 <= a < len(ops)]
        if not arch or bad:
            raise ValueError(f"architecture {arch} has choices {bad or 'none'} outside "
                             f"0..{len(ops) - 1} ({', '.join(ops)}).\n"
                             "HINT: use the 'arch' of a search.json written by hpc search.")
        self.arch = arch
        self.kwargs = {"in_channels": in_channels, "num_classes": num_classes,
                       "width": width, "ops": list(ops)}
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width), nn.ReLU(inplace=True))
        self.ops = nn.ModuleList(build_op(ops[a], width) for a in arch)
        self.pool_after = len(arch) // 2
        self.pool = nn.AvgPool2d(2)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        """Logits; the same operations in the same order as ``Supernet.forward``."""
        x = self.stem(x)
        for index, op in enumerate(self.ops):
            if index == self.pool_after and index > 0:
                x = self.pool(x)
            if not isinstance(op, nn.Identity):
                x = x + op(x)
        return self.head(x.mean(dim=(2, 3)))


def extract(space: nn.Module, arch: Sequence[int]) -> nn.Module:
    """The standalone sub-network ``arch`` of ``space``, with copies of its weights.

    For a :class:`~hpc.pretrain.space.Supernet` this is a :class:`SubNet`; any other
    space must provide ``subnet(arch) -> nn.Module``. The result is on ``space``'s
    device, in train mode, sharing no tensor with ``space``.

    Raises:
        TypeError: ``space`` is neither a ``Supernet`` nor has ``subnet(arch)``.
    """
    if not isinstance(space, Supernet):
        subnet = getattr(space, "subnet", None)
        if subnet is None:
            raise TypeError(
                f"cannot extract a sub-network from a {type(space).__qualname__}: it is "
                "not an hpc.pretrain.Supernet and has no subnet(arch) method.\n"
                "HINT: add subnet(arch) -> nn.Module returning the chosen operations "
                "with copies of their weights.")
        return subnet(arch)
    first = space.stem[0]
    net = SubNet(arch, in_channels=first.in_channels, num_classes=space.head.out_features,
                 width=first.out_channels, ops=space.candidates)
    if len(net.ops) != len(space.blocks):
        raise ValueError(f"architecture {tuple(arch)} has {len(net.ops)} choices but the "
                         f"supernet has {len(space.blocks)} blocks.\n"
                         "HINT: search and tune the same pretrain run.")
    net.to(next(space.parameters()).device)
    with torch.no_grad():
        net.stem.load_state_dict(space.stem.state_dict())
        net.head.load_state_dict(space.head.state_dict())
        for op, block, choice in zip(net.ops, space.blocks, net.arch):
            op.load_state_dict(block[choice].state_dict())
    return net.train(space.training)


def count_params(module: nn.Module) -> int:
    """Number of parameters (elements) of ``module``."""
    return sum(p.numel() for p in module.parameters())


def save_model(net: SubNet, path: Union[str, Path], **extra: Any) -> Path:
    """Write ``net`` to ``path`` atomically (with a ``.sha256`` sidecar).

    ``extra`` (plain values: accuracy, the search it came from) is stored alongside.
    """
    payload = {"format": MODEL_FORMAT, "arch": list(net.arch), "kwargs": dict(net.kwargs),
               "state_dict": {k: v.detach().cpu() for k, v in net.state_dict().items()},
               **extra}
    return save_atomic(payload, path)


def load_model(path: Union[str, Path], map_location: Any = "cpu") -> SubNet:
    """Rebuild the :class:`SubNet` saved by :func:`save_model` (in eval mode).

    Raises:
        ValueError: ``path`` is not a model file written by :func:`save_model`.
    """
    payload = torch.load(path, map_location=map_location, weights_only=True)
    if not isinstance(payload, dict) or "arch" not in payload or "state_dict" not in payload:
        raise ValueError(f"{path} is not a model file written by hpc tune (no 'arch' and "
                         "'state_dict').\nHINT: load DIR/model.pt of an hpc tune run.")
    net = SubNet(payload["arch"], **payload.get("kwargs", {}))
    net.load_state_dict(payload["state_dict"])
    return net.eval()
