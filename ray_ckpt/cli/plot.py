"""``ray-ckpt inspect URI --plot lineage.png``: a picture of the lineage on storage.

Steps on the x axis, one lane per generation (each attach, resume or branch starts one): full checkpoints as
triangles, diff objects as bars over the steps they cover (merged Amber increments hatched), lost steps (gaps)
as red spans, the step each generation started from (a restore or a fresh start) as a dashed line, and the
range a restore of that generation can reach as a thin green line. Durable storage only: the CLI needs no
cluster (the memory tier is in ``Checkpointer.stats()`` and the metrics). Runs in the calling process;
needs matplotlib (``pip install 'ray_ckpt[plot]'``).
"""
from __future__ import annotations


def plot_lineage(lineage, path: str, title: str) -> dict:
    """Draw ``lineage`` to ``path`` (PNG, SVG or PDF by extension). Returns what was drawn (counts)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("ray-ckpt: --plot needs matplotlib: pip install 'ray_ckpt[plot]'") from None
    from ray_ckpt.lineage.manifest import LAZY_DURABLE_DIFFS
    gens = lineage.generations
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.7 * max(1, len(gens))))
    drawn = {"generations": len(gens), "fulls": 0, "diffs": 0, "gap_steps": 0}
    for lane, gen in enumerate(gens):
        ms = [m for m in lineage.manifests if m.generation == gen]
        y = lane
        reach = lineage.reachable_steps(gen)
        if reach:
            ax.plot([reach[0], reach[-1]], [y - 0.32, y - 0.32], color="tab:green", lw=1.5,
                    label="recoverable" if lane == 0 else None)
        for m in ms:
            if m.kind == "full":
                ax.plot([m.last_step], [y], marker="^", color="tab:blue", ms=9, ls="none",
                        label="full" if drawn["fulls"] == 0 else None)
                drawn["fulls"] += 1
            else:
                merged = bool(m.info.get("atomic"))
                ax.barh(y, m.last_step - m.first_step + 1, left=m.first_step - 0.5, height=0.35,
                        color="tab:orange", alpha=0.6, edgecolor="tab:orange", hatch="//" if merged else None,
                        label="diffs" if drawn["diffs"] == 0 else None)
                drawn["diffs"] += 1
        lazy = any(m.info.get("durable_diffs") in LAZY_DURABLE_DIFFS for m in ms)
        gaps = [] if lazy else lineage.uncovered_steps(gen)
        for s in gaps:
            ax.axvspan(s - 0.5, s + 0.5, ymin=(lane + 0.1) / len(gens), ymax=(lane + 0.9) / len(gens),
                       color="red", alpha=0.35, label="lost steps" if drawn["gap_steps"] == 0 else None)
            drawn["gap_steps"] += 1
        start = lineage.start_of(gen)
        if start is not None:
            ax.axvline(start, ymin=lane / len(gens), ymax=(lane + 1) / len(gens), color="black", ls="--", lw=1)
            ax.annotate(f"start {start}", (start, y + 0.25), fontsize=7, xytext=(3, 0), textcoords="offset points")
    ax.set_yticks(range(len(gens)), [f"generation {g}" for g in gens])
    ax.set_ylim(-0.7, len(gens) - 0.3)
    ax.set_xlabel("step")
    ax.set_title(title, fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    if gens:
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return drawn
