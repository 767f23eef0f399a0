"""PNG plots of a replay report: TTFT and TPOT distributions, throughput
over time, KV bytes per link. Rendered off-screen (Agg), no display needed."""

from __future__ import annotations

from pathlib import Path


def write_plots(report: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reqs = [r for r in report["requests"] if r["error"] is None and r["end_s"] is not None]
    written = []

    def save(fig, name: str) -> None:
        path = out / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    for key, title in (("ttft", "Time to first token"), ("tpot", "Time per output token")):
        vals = []
        for r in reqs:
            times = r["token_times"]
            if key == "ttft" and times:
                vals.append((times[0] - r["sent_s"]) * 1e3)
            elif key == "tpot" and len(times) > 1:
                vals.append((r["end_s"] - times[0]) / (len(times) - 1) * 1e3)
        fig, ax = plt.subplots(figsize=(6, 3.5))
        if vals:
            vals.sort()
            ax.plot(vals, [(i + 1) / len(vals) for i in range(len(vals))], drawstyle="steps-post")
        ax.set(xlabel=f"{key.upper()} (ms)", ylabel="fraction of requests", title=f"{title} (CDF, n={len(vals)})")
        ax.grid(alpha=0.3)
        save(fig, f"{key}_cdf.png")

    fig, ax = plt.subplots(figsize=(6, 3.5))
    token_times = sorted(t for r in reqs for t in r["token_times"])
    if token_times:
        width = max(1.0, (token_times[-1] - token_times[0]) / 40)
        bins = [token_times[0] + i * width for i in range(int((token_times[-1] - token_times[0]) / width) + 2)]
        ax.hist(token_times, bins=bins, weights=[1 / width] * len(token_times))
    ax.set(xlabel="time since start (s)", ylabel="output tokens / s", title="Throughput over time")
    ax.grid(alpha=0.3)
    save(fig, "throughput.png")

    fig, ax = plt.subplots(figsize=(6, 3.5))
    links = report["per_link"]
    names = list(links)
    ax.bar(names, [links[n]["kv_bytes"] / 2**20 for n in names])
    ax.set(ylabel="KV moved (MiB)", title="KV bytes per link")
    save(fig, "kv_bytes_per_link.png")
    return written
