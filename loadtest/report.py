"""Turn bench_serving result JSONs into one markdown table (and a PNG plot if matplotlib is there).

python loadtest/report.py results/disagg-*.json --output results/disagg.md --plot results/disagg.png
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

COLUMNS = (
    # (header, section of the summary, key); latencies in ms
    ("TTFT p50", "ttft_ms", "p50"),
    ("TTFT p99", "ttft_ms", "p99"),
    ("TPOT p50", "tpot_ms", "p50"),
    ("TPOT p99", "tpot_ms", "p99"),
    ("ITL p50", "itl_ms", "p50"),
    ("ITL p99", "itl_ms", "p99"),
    ("E2E p50", "e2e_ms", "p50"),
    ("E2E p99", "e2e_ms", "p99"),
)


def load(paths: Sequence[str | Path]) -> list[tuple[str, dict[str, Any]]]:
    """(name, result) per file; the name is the run's --label, else the file name."""
    runs = []
    for path in paths:
        result = json.loads(Path(path).read_text())
        runs.append((result["config"].get("label") or Path(path).stem, result))
    return runs


def _num(value: Any, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def render_markdown(runs: Sequence[tuple[str, dict[str, Any]]]) -> str:
    header = ["run", "in / out", "rate (req/s)", "max conc.", "ok / failed", "req/s", "out tok/s"]
    header += [f"{h} (ms)" for h, _, _ in COLUMNS]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, result in runs:
        c, s = result["config"], result["summary"]
        row = [
            name,
            f"{c['input_len']} / {c['output_len']}",
            str(c["request_rate"]),
            _num(c.get("max_concurrency")) if c.get("max_concurrency") else "-",
            f"{s['completed']} / {s['failed']}",
            _num(s["request_throughput"], 2),
            _num(s["output_throughput"], 1),
        ]
        row += [_num(s[section].get(key)) for _, section, key in COLUMNS]
        lines.append("| " + " | ".join(row) + " |")
    note = (
        "\nLatencies over successful requests, measured by the client; "
        "in / out: prompt length, max_tokens.\n"
    )
    return "\n".join(lines) + "\n" + note


def _x_axis(runs: Sequence[tuple[str, dict[str, Any]]]) -> tuple[str, list[float]]:
    """Plot against whatever the runs varied: request rate, else max concurrency, else run order."""
    rates = [r["config"]["request_rate"] for _, r in runs]
    if all(isinstance(x, int | float) for x in rates) and len(set(rates)) > 1:
        return "request rate (req/s)", [float(x) for x in rates]
    conc = [r["config"].get("max_concurrency") for _, r in runs]
    if all(isinstance(x, int) for x in conc) and len(set(conc)) > 1:
        return "max concurrency", [float(x) for x in conc]
    return "run", [float(i) for i in range(len(runs))]


def plot(runs: Sequence[tuple[str, dict[str, Any]]], path: str | Path) -> bool:
    """Throughput and tail latencies against the varied parameter; False if matplotlib is absent."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    label, xs = _x_axis(runs)
    order = sorted(range(len(runs)), key=xs.__getitem__)  # lines, not zigzags, for unsorted files
    runs, xs = [runs[i] for i in order], [xs[i] for i in order]
    summaries = [r["summary"] for _, r in runs]
    fig, (ax_tput, ax_lat) = plt.subplots(1, 2, figsize=(11, 4))
    ax_tput.plot(xs, [s["output_throughput"] for s in summaries], marker="o")
    ax_tput.set(xlabel=label, ylabel="output tokens/s", title="Throughput")
    for section, name in (("ttft_ms", "TTFT p99"), ("tpot_ms", "TPOT p99"), ("itl_ms", "ITL p99")):
        ys = [s[section].get("p99") for s in summaries]
        ax_lat.plot(xs, [math.nan if y is None else y for y in ys], marker="o", label=name)
    ax_lat.set(xlabel=label, ylabel="ms", title="Tail latency", yscale="log")
    ax_lat.legend()
    if label == "run":
        for ax in (ax_tput, ax_lat):
            ax.set_xticks(xs, [name for name, _ in runs], rotation=30, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_series(results: Sequence[dict[str, Any]], metric: str, path: str | Path, by: str) -> bool:
    """p50 and p99 of one latency (`ttft_ms`, `itl_ms`, ...) against the request rate, one pair
    of lines per value of `by` in the results (e.g. each placement); False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for group in dict.fromkeys(r[by] for r in results):
        runs = sorted(
            (r for r in results if r[by] == group), key=lambda r: r["config"]["request_rate"]
        )
        rates = [r["config"]["request_rate"] for r in runs]
        for p, style in (("p50", "o-"), ("p99", "s--")):
            ys = [r["summary"][metric].get(p) for r in runs]
            ax.plot(rates, [math.nan if y is None else y for y in ys], style, label=f"{group} {p}")
    name = metric.removesuffix("_ms").upper()
    ax.set(xlabel="request rate (req/s)", ylabel=f"{name} (ms)", title=f"{name} vs request rate")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("results", nargs="+", help="result JSONs from bench_serving.py --output")
    p.add_argument("--output", help="write the markdown here (default: stdout)")
    p.add_argument("--plot", help="also write a PNG plot here (needs matplotlib)")
    a = p.parse_args(argv)
    runs = load(a.results)
    text = render_markdown(runs)
    if a.output:
        Path(a.output).write_text(text)
    else:
        sys.stdout.write(text)
    if a.plot and not plot(runs, a.plot):
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
