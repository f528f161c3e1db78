"""Draw the layout of the workspace ``dettrain panel`` saves, from its ``--dry-run`` spec (docs/panel_layout.png).

    python -m dettrain.panel --entity ENTITY --project dettrain --group GROUP --dry-run --out spec.json
    python examples/panel_layout.py spec.json docs/panel_layout.png

Only the wandb view spec is read (sections, their columns, each panel's type, title and metric keys), so the picture
shows what the server gets.  The sketches inside the boxes are schematic (what such a panel looks like for a group
with one rerun that matches the reference and one that parts from it), not data.
"""

from __future__ import annotations

import json
import random
import sys
import textwrap

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyBboxPatch, Rectangle  # noqa: E402

KIND = {"Run History Line Plot": "line", "Bar Chart": "bar", "Run Comparer": "compare"}
REF, SAME, OTHER = "#1f77b4", "#ff7f0e", "#2ca02c"


def sections(view: dict) -> list[tuple[str, int, list[dict]]]:
    """(name, columns, panels) of each section of a wandb view spec, in order."""
    out = []
    for s in view["spec"]["section"]["panelBankConfig"]["sections"]:
        out.append((s["name"], int(s["flowConfig"]["columnsPerPage"]), s["panels"]))
    return out


def sketch(ax, kind: str, keys: str, x0: float, y0: float, w: float, h: float) -> None:
    """A schematic of the panel inside the box (x0, y0, w, h)."""
    rng = random.Random(keys)  # the same picture every time
    n = 14
    xs = [x0 + w * i / (n - 1) for i in range(n)]
    if kind == "line" and keys.startswith("fp24/"):
        # hash channels: the rerun lies on the reference; the other run parts from it at the 6th step
        ref = [y0 + h * rng.uniform(0.05, 0.95) for _ in range(n)]
        other = ref[:5] + [y0 + h * rng.uniform(0.05, 0.95) for _ in range(n - 5)]
        ax.plot(xs, other, color=OTHER, lw=0.9)
        ax.plot(xs, ref, color=REF, lw=2.4)
        ax.plot(xs, ref, color=SAME, lw=0.9, ls="--")
    elif kind == "line" and keys == "ref/match":
        ax.step(xs, [y0 + h * 0.9] * n, color=SAME, lw=1.5, where="post")
    elif kind == "line" and keys == "ref/loss_ulps":
        ax.plot(xs, [y0 + h * 0.05] * n, color=SAME, lw=1.5)
    elif kind == "line":
        ax.plot(xs, [y0 + h * (0.9 - 0.75 * (i / (n - 1)) ** 0.5) for i in range(n)], color=REF, lw=1.5)
    elif kind == "bar":
        # matching steps: the reference and the rerun all of them, the other run 5; first divergence: only it
        bars = ((1.0, REF), (1.0, SAME), (0.36, OTHER)) if "matching" in keys else ((0, REF), (0, SAME), (0.36, OTHER))
        for j, (frac, c) in enumerate(bars):
            if frac:
                ax.add_patch(Rectangle((x0, y0 + h * (0.7 - 0.33 * j)), w * frac * 0.9, h * 0.22, color=c))
            else:
                ax.text(x0, y0 + h * (0.81 - 0.33 * j), "null", fontsize=7, color=c, va="center")
    else:  # run comparer: a table with one differing row
        for j in range(5):
            yy = y0 + h * (0.95 - 0.22 * j)
            ax.plot([x0, x0 + w], [yy, yy], color="#bbbbbb", lw=0.8)
        ax.add_patch(Rectangle((x0, y0 + h * 0.29), w, h * 0.22, color="#fde0dd"))


def draw(spec: dict, out: str) -> None:
    secs = sections(spec["workspace"])
    rows = [(name, cols, panels[i : i + cols]) for name, cols, panels in secs for i in range(0, len(panels), cols)]
    fig_w, row_h, head_h = 12.0, 1.9, 0.45
    heads = len(secs)
    fig_h = len(rows) * row_h + heads * head_h + 1.0
    fig = plt.figure(figsize=(fig_w, fig_h), dpi=64)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, fig_w)
    ax.set_ylim(0, fig_h)
    ax.axis("off")
    y = fig_h - 0.5
    ax.text(0.2, y, f"wandb workspace '{spec['workspace']['displayName']}': runs of group {spec['group']}, oldest "
            f"first (reference: {spec['reference'] or 'the oldest run'})", fontsize=11, weight="bold", va="center")
    seen = set()
    for name, cols, panels in rows:
        if name not in seen:
            seen.add(name)
            y -= head_h
            ax.text(0.2, y + head_h / 2, "\u25be " + name, fontsize=10, weight="bold", va="center", color="#333333")
        y -= row_h
        bw = (fig_w - 0.4) / cols
        for i, p in enumerate(panels):
            x = 0.2 + i * bw
            ax.add_patch(FancyBboxPatch((x + 0.05, y + 0.05), bw - 0.1, row_h - 0.1, boxstyle="round,pad=0.02",
                                        fc="#f7f7f7", ec="#999999", lw=0.8))
            cfg = p.get("config") or {}
            kind = KIND.get(p["viewType"], "line")
            title = cfg.get("chartTitle") or {"compare": "run comparer (config, summary)"}.get(kind, kind)
            keys = ", ".join(m.replace("summary_metrics.", "summary:") for m in cfg.get("metrics") or [])
            ax.text(x + 0.12, y + row_h - 0.17, "\n".join(textwrap.wrap(title, int(bw * 12))[:2]), fontsize=7.5,
                    va="top")
            if keys:
                ax.text(x + 0.12, y + 0.14, keys, fontsize=7, family="monospace", color="#8c2d04")
            sketch(ax, kind, keys, x + 0.2, y + 0.38, bw - 0.45, row_h - 0.98)
    ax.text(0.2, 0.2, "schematic, three runs: the reference (blue, thick), a rerun with the same bits (orange, "
            "dashed, on top of it), a run that parts from it at step 5 (green)", fontsize=8, color="#555555")
    fig.savefig(out)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python examples/panel_layout.py SPEC.json OUT.png", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        draw(json.load(f), argv[1])
    print(f"wrote {argv[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
