"""Plots of a `benchmarks/suite.py` or `benchmarks/many_adapters.py` run, drawn with matplotlib (AIPerf's
virtualenv has it; ours does not).

    .cache/aiperf-venv/bin/python benchmarks/plots.py SUITE_OR_MANY_ADAPTERS_JSON OUT_DIR

Writes, for the parts the run has, and prints each file's path:
  many_adapters.png       many_adapters.py: output tokens/s, and TTFT p99 of cold and warm requests, per
                          workload (base, 8, 1,000 and 2,000 adapters, uniform and Zipf), one series per server
  throughput_vs_load.png  batching: output tokens/s and TTFT p99 against offered load, continuous and static
  latency_cdf.png         batching at its highest rate: TTFT and e2e latency CDFs, continuous and static;
                          prefix: TTFT CDFs with the prefix cache on and off
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

STYLE = {"continuous": "C0", "static": "C3", "no-prefix-cache": "C3"}


def cdf(ax, values: list[float], label: str, color: str) -> None:
    """An empirical CDF of values (ms, log x)."""
    xs = sorted(values)
    ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=label, color=color)
    ax.set_xscale("log")
    ax.set_ylabel("fraction of requests")
    ax.grid(True, alpha=0.3)


def throughput_vs_load(batching: dict, path: Path) -> None:
    fig, (tput, ttft) = plt.subplots(1, 2, figsize=(10, 4))
    for config in ("continuous", "static"):
        runs = sorted((r for r in batching["results"] if r["config"] == config), key=lambda r: r["rate"])
        rates = [r["rate"] for r in runs]
        tput.plot(rates, [r["output_tokens_per_s"] for r in runs], "o-", label=config, color=STYLE[config])
        ttft.plot(rates, [r["ttft_p99_ms"] for r in runs], "o-", label=config, color=STYLE[config])
    tput.set(xlabel="offered load (requests/s)", ylabel="output tokens/s", title="throughput")
    ttft.set(xlabel="offered load (requests/s)", ylabel="TTFT p99 (ms)", title="time to first token, p99",
             yscale="log")
    for ax in (tput, ttft):
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def latency_cdfs(parts: dict, path: Path) -> None:
    panels = []
    if "batching" in parts:
        rate = max(parts["batching"]["rates"])
        runs = [r for r in parts["batching"]["results"] if r["rate"] == rate]
        panels += [(f"TTFT at {rate:g} requests/s", runs, "ttft_ms_all"),
                   (f"e2e latency at {rate:g} requests/s", runs, "e2e_ms_all")]
    if "prefix" in parts:
        panels.append((f"TTFT, prefix cache on / off ({parts['prefix']['model']})", parts["prefix"]["results"],
                       "ttft_ms_all"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (title, runs, key) in zip(axes[0], panels):
        for r in runs:
            if r[key]:
                cdf(ax, r[key], r["config"], STYLE.get(r["config"], "C2"))
        ax.set(title=title, xlabel="ms")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def many_adapters(results: list[dict], path: Path) -> None:
    """many_adapters.py's runs: tok/s and TTFT p99 (cold: hollow markers, warm: filled) by workload and server."""
    workloads = list(dict.fromkeys(r["workload"] for r in results))
    servers = list(dict.fromkeys(r["server"] for r in results))
    fig, (tps, ttft) = plt.subplots(1, 2, figsize=(12, 4.2))
    for k, server in enumerate(servers):
        runs = {r["workload"]: r for r in results if r["server"] == server}
        xs = [i for i, w in enumerate(workloads) if w in runs]
        tps.plot(xs, [runs[workloads[i]]["output_tokens_per_s"] for i in xs], "o-", color=f"C{k}", label=server)
        for kind, fill in (("warm", f"C{k}"), ("cold", "none")):
            pts = [(i, runs[workloads[i]][f"ttft_{kind}_p99_ms"]) for i in xs
                   if runs[workloads[i]].get(f"ttft_{kind}_p99_ms") is not None]
            if pts:
                ttft.plot(*zip(*pts), "o", color=f"C{k}", markerfacecolor=fill, label=f"{server} {kind}")
    for ax in (tps, ttft):
        ax.set_xticks(range(len(workloads)), workloads, rotation=30, ha="right")
        ax.grid(alpha=0.3)
    tps.set_ylabel("output tokens/s")
    tps.set_ylim(bottom=0)
    ttft.set_ylabel("TTFT p99 ms (hollow: cold adapter)")
    ttft.set_yscale("log")
    tps.legend(fontsize=8)
    ttft.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    report = json.loads(Path(argv[0]).read_text())
    out_dir = Path(argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    if "parts" not in report:  # many_adapters.py
        many_adapters(report["results"], out_dir / "many_adapters.png")
        print(out_dir / "many_adapters.png")
        return 0
    parts, written = report["parts"], []
    if "batching" in parts:
        throughput_vs_load(parts["batching"], out_dir / "throughput_vs_load.png")
        written.append(out_dir / "throughput_vs_load.png")
    if "batching" in parts or "prefix" in parts:
        latency_cdfs(parts, out_dir / "latency_cdf.png")
        written.append(out_dir / "latency_cdf.png")
    print("\n".join(map(str, written)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
