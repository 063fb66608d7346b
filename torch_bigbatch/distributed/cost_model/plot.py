"""The cost model's figure: the projection per algorithm and preset, and the calibration."""

from .alpha_beta import ALGORITHMS

COLORS = {"ring": "tab:blue", "tree": "tab:purple", "hierarchical": "tab:orange",
          "torus": "tab:green", "pipelined": "tab:red"}


def plot(projections, calibration, path):
    """Left: the allreduce time per algorithm and preset; middle: scaling efficiency;
    right (with a calibration): loopback model against measurement."""
    import matplotlib  # only here: the model and its table need no plotting library
    matplotlib.use("Agg")
    from matplotlib import pyplot

    panels = 3 if calibration else 2
    figure, axes = pyplot.subplots(1, panels, figsize=(5.5 * panels, 4))
    styles = ["-", "--", ":", "-."]
    for style, (hardware, rows) in zip(styles, projections):
        gpus = [row["gpus"] for row in rows]
        for name in ALGORITHMS:
            label = f"{hardware.name} {name}"
            axes[0].plot(gpus, [row[f"{name}_ms"] for row in rows], style, color=COLORS[name],
                         label=label)
            axes[1].plot(gpus, [100 * row[f"{name}_efficiency"] for row in rows], style,
                         color=COLORS[name], label=label)
    for axis, title in zip(axes, ("ResNet-50 allreduce (ms)", "scaling efficiency (%)")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("GPUs")
        axis.set_title(title)
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=7)
    if calibration:
        alpha, beta, table = calibration
        rank_counts = sorted({row["ranks"] for row in table})
        for backend, color in (("gloo", "tab:blue"), ("torus", "tab:red")):
            for ranks in rank_counts:
                rows = [row for row in table if row["backend"] == backend and
                        row["ranks"] == ranks]
                sizes = [row["bytes"] for row in rows]
                shade = 0.3 + 0.7 * ranks / rank_counts[-1]  # darker: more ranks
                axes[2].plot(sizes, [row["measured_ms"] for row in rows], "o", color=color,
                             alpha=shade)
                axes[2].plot(sizes, [row["model_ms"] for row in rows], "-", color=color,
                             alpha=shade, label=f"{backend} {ranks} ranks")
        axes[2].set_xscale("log", base=2)
        axes[2].set_yscale("log")
        axes[2].set_xlabel("bytes")
        axes[2].set_title(f"loopback: model (lines) vs measured (dots)\nalpha "
                          f"{alpha * 1e3:.2f} ms, {1 / beta / 1e9:.2f} GB/s per core")
        axes[2].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    pyplot.close(figure)
