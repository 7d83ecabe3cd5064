"""``hpc check``'s output: the text table, the JSON record and the PNG of the pair matrix."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from hpc.check.runner import Results
from hpc.check.verdict import Figure

__all__ = ["format_table", "to_json", "write_png"]


def _size(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n:g} B"


def _fig_cells(f: Figure) -> str:
    return (f"{f.ranks:>5} {f.seconds * 1e3:>9.2f} {f.algbw / 1e9:>11.4g} "
            f"{f.busbw / 1e9:>11.4g} {f.latency * 1e6:>11.1f}")


def format_table(res: Results) -> str:
    """The per-rank table, the pair table, the ring line (no verdict)."""
    s = res.settings
    lines = [(f"hpc check: {s['world']} ranks on {len({r['host'] for r in res.rows})} "
              f"node(s), backend {s['backend']}, device {s['device']}; GEMM "
              f"{s['gemm']}x{s['gemm']}, copy {_size(s['copy'])}, all_reduce "
              f"{_size(s['size'])}, latency of a 4-byte all_reduce")]
    lines.append(f"{'rank':>4} {'host':<12} {'device':<8} {'GEMM GFLOP/s':>12} "
                 f"{'copy GB/s':>10} {'GPUs':>4}  visible")
    for r in res.rows:
        vis = " ".join(f"{k}={r[k]}" for k in ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES",
                                                 "HIP_VISIBLE_DEVICES") if k in r) or "-"
        gpu = f" {r['gpu_name']}" if r.get("gpu_name") else ""
        lines.append(f"{r['rank']:>4} {r['host']:<12} {r['device']:<8} {r['gemm'] / 1e9:>12.1f} "
                     f"{r['copy'] / 1e9:>10.2f} {r['gpus']:>4}  {vis}{gpu}")
    width = max([len(x) for x in res.labels] + [6])
    head = (f"{'pair':<{2 * width + 1}} {'ranks':>5} {'time ms':>9} {'algbw GB/s':>11} "
            f"{'busbw GB/s':>11} {'latency us':>11}")
    if res.pairs:
        lines += ["", f"{res.unit_kind} pairs, all_reduce (busbw = algbw x 2(n-1)/n):", head]
        for (a, b), f in sorted(res.pairs.items()):
            lines.append(f"{res.labels[a]:<{width}} {res.labels[b]:<{width}} {_fig_cells(f)}")
    if res.remeasured:
        lines += ["", "timed again alone, as the rounds flagged them (the better figure counts):"]
        for (a, b), (first, alone) in sorted(res.remeasured.items()):
            lines.append(f"{res.labels[a]:<{width}} {res.labels[b]:<{width}} busbw "
                         f"{first.busbw / 1e9:.4g} -> {alone.busbw / 1e9:.4g} GB/s, latency "
                         f"{first.latency * 1e6:.1f} -> {alone.latency * 1e6:.1f} us")
    if res.ring is not None:
        lines += ["", head.replace("pair", "ring", 1),
                  f"{'all ranks':<{2 * width + 1}} {_fig_cells(res.ring)}"]
    return "\n".join(lines)


def to_json(res: Results) -> dict[str, Any]:
    """The results as plain JSON-able data (pairs as ``{"a": .., "b": .., ...}``)."""
    def fig(f: Figure) -> dict[str, Any]:
        return {"ranks": f.ranks, "bytes": f.nbytes, "seconds": f.seconds,
                "algbw": f.algbw, "busbw": f.busbw, "latency": f.latency}

    return {"settings": res.settings, "ranks": res.rows, "unit_kind": res.unit_kind,
            "units": res.labels, "members": res.members,
            "pairs": [{"a": res.labels[a], "b": res.labels[b], **fig(f),
                       **({"first": fig(res.remeasured[(a, b)][0]),
                           "alone": fig(res.remeasured[(a, b)][1])}
                          if (a, b) in res.remeasured else {})}
                      for (a, b), f in sorted(res.pairs.items())],
            "ring": fig(res.ring) if res.ring else None,
            "findings": [{"kind": f.kind, "names": list(f.names), "text": f.text}
                         for f in res.findings]}


def write_json(res: Results, path: Path) -> None:
    """Write :func:`to_json` to ``path``."""
    path.write_text(json.dumps(to_json(res), indent=1) + "\n")


def write_png(res: Results, path: Path) -> str:
    """Draw the pair matrices (busbw, latency) into ``path``; returns a note for the log
    (matplotlib is optional: without it, no picture and a note saying so)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ("PNG skipped: matplotlib is not installed "
                "(pip install 'torch-hpc[pretrain]' brings it)")
    n = len(res.labels)
    bw = [[math.nan] * n for _ in range(n)]
    lat = [[math.nan] * n for _ in range(n)]
    for (a, b), f in res.pairs.items():
        bw[a][b] = bw[b][a] = f.busbw / 1e9
        lat[a][b] = lat[b][a] = f.latency * 1e6
    fig, axes = plt.subplots(1, 2, figsize=(4 + 1.4 * n, 2.2 + 0.6 * n), squeeze=False)
    for ax, grid, title, cmap in ((axes[0][0], bw, "busbw GB/s", "viridis"),
                                  (axes[0][1], lat, "latency us", "viridis_r")):
        im = ax.imshow(grid, cmap=cmap)
        ax.set_title(f"{res.unit_kind} pairs: {title}")
        ax.set_xticks(range(n), res.labels, rotation=45, ha="right", fontsize=8)
        ax.set_yticks(range(n), res.labels, fontsize=8)
        for i in range(n):
            for j in range(n):
                if not math.isnan(grid[i][j]):
                    level = float(im.norm(grid[i][j]))  # 0..1 along the colour map
                    bright = level > 0.6 if cmap == "viridis" else level < 0.4
                    ax.text(j, i, f"{grid[i][j]:.3g}", ha="center", va="center",
                            fontsize=8, color="black" if bright else "white")
        fig.colorbar(im, ax=ax, shrink=0.8)
    flagged = sorted({name for f in res.findings for name in f.names})
    fig.suptitle("hpc check: " + (f"flagged {', '.join(flagged)}" if flagged else "no outliers"),
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"pair matrix: {path}"
