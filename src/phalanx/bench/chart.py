"""bench.png: samples/s against devices with the ideal line, and the step time split per device count."""

from __future__ import annotations

from pathlib import Path

from phalanx.bench.scaling import Scaling

CHART_HINT = "phalanx: matplotlib is not installed, so there is no bench.png; `pip install phalanx[bench]` adds it"


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def write_chart(rows: list[Scaling], path: Path, *, title: str, units: str = "devices") -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display, and no GUI toolkit needed
    import matplotlib.pyplot as plt

    counts = [row.nproc for row in rows]
    base = rows[0].run.samples_per_s
    fig, (rate, split) = plt.subplots(1, 2, figsize=(11, 5))
    try:
        rate.plot(counts, [n * base for n in counts], "--", color="grey", label="ideal (linear)")
        rate.plot(counts, [row.run.samples_per_s for row in rows], "o-", color="tab:blue", label="measured")
        for row in rows:
            rate.annotate(
                f"{row.efficiency:.0%}",
                (row.nproc, row.run.samples_per_s),
                textcoords="offset points",
                xytext=(0, 8),
                ha="center",
                fontsize=9,
            )
        rate.set_xlabel(units)
        rate.set_ylabel("samples/s (median step)")
        rate.set_xticks(counts)
        rate.set_ylim(
            0, max(max(n * base for n in counts), max(row.run.samples_per_s for row in rows)) * 1.15
        )  # room for the labels
        rate.set_title("throughput; labels: scaling efficiency", fontsize=10)
        rate.legend(loc="upper left")

        x = list(range(len(rows)))
        compute = [row.compute * 1000 for row in rows]
        comm = [row.comm_wait * 1000 for row in rows]
        data = [row.run.data_wait * 1000 for row in rows]
        split.bar(x, compute, color="tab:green", label="compute (1-device step - its data wait)")
        split.bar(x, comm, bottom=compute, color="tab:red", label="communication wait (the rest)")
        split.bar(
            x, data, bottom=[a + b for a, b in zip(compute, comm)], color="tab:orange", label="data wait (measured)"
        )
        # The bars overshoot the step where it came out shorter than the 1-device compute (comm clamped at 0).
        split.hlines(
            [row.run.step_time * 1000 for row in rows],
            [i - 0.4 for i in x],
            [i + 0.4 for i in x],
            colors="black",
            linewidth=2,
            label="measured step time",
        )
        split.set_xticks(x, [str(n) for n in counts])
        split.set_xlabel(units)
        split.set_ylabel("ms per step (median)")
        split.set_title("step time split", fontsize=10)
        split.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2, fontsize=8)

        fig.suptitle(title, fontsize=10)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
