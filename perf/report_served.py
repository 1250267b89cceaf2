#!/usr/bin/env python3
"""Render kvf_served_bench results (JSON lines) as a markdown table and a plot.

  report_served.py OUTDIR FILE.jsonl...

Writes OUTDIR/served.json (every row, one JSON array), OUTDIR/served.md (a
table: served GB/s, its ratio to the in-process kernel and to a contiguous
memcpy of the same bytes measured in the same run, p50 latency; and the
first STORE after a registration against later ones) and
OUTDIR/served.png (GB/s against requests in flight; skipped without
matplotlib).
"""
import json
import os
import sys

from report import open_result


def load(paths):
    rows = []
    for p in paths:
        with open_result(p) as f:
            rows += [json.loads(line) for line in f if line.strip()]
    return rows


def table(rows):
    out = [
        "| GPU | direction | tokens/request | MiB/request | in flight | served GB/s | in-process GB/s | memcpy GB/s "
        "| served / in-process | in-process rounds GB/s | served / in-process rounds | served / memcpy "
        "| latency p50 / mean / p90 / max ms |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in sorted(rows, key=lambda r: (r["direction"] != "store", r["tokens_per_request"], r["inflight"],
                                         r["device"])):
        rounds = r.get("inproc_rounds_gbps", 0)
        lat = " / ".join("%.3f" % r[k] if k in r else "–" for k in
                         ("latency_ms_p50", "latency_ms_mean", "latency_ms_p90", "latency_ms_max"))
        out.append(
            "| %d | %s | %d | %.1f | %d | %.2f | %.2f | %.2f | %.1f%% | %s | %s | %.1f%% | %s |"
            % (r["device"], r["direction"], r["tokens_per_request"], r["bytes_per_request"] / 2**20, r["inflight"],
               r["served_gbps"], r["inproc_gbps"], r["memcpy_gbps"], 100 * r["ratio_to_inproc"],
               "%.2f" % rounds if rounds else "–",
               "%.1f%%" % (100 * r["ratio_to_inproc_rounds"]) if rounds else "–",
               100 * r["ratio_to_memcpy"], lat))
    return "\n".join(out) + "\n"


def plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("report_served.py: no matplotlib, plot skipped", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    keys = sorted({(r["device"], r["direction"], r["tokens_per_request"]) for r in rows})
    for dev, d, t in keys:
        rs = sorted((r for r in rows if r["device"] == dev and r["direction"] == d and r["tokens_per_request"] == t),
                    key=lambda r: r["inflight"])
        ax.plot([r["inflight"] for r in rs], [r["served_gbps"] for r in rs], marker="o",
                label="GPU %d %s, %d tokens/request" % (dev, d, t))
    lim = max(r["memcpy_gbps"] for r in rows)
    ax.axhline(lim, color="gray", linestyle="--", label="contiguous memcpy (%.1f GB/s)" % lim)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("requests in flight")
    ax.set_ylabel("payload GB/s")
    r0 = rows[0]
    gpus = ",".join(str(d) for d in sorted({r["device"] for r in rows}))
    ax.set_title("kvferryd STORE / RETRIEVE, %s, GPU %s (%s)" % (r0["geometry"], gpus, r0["date"][:10]))
    ax.set_ylim(0, lim * 1.15)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    if len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    outdir, paths = sys.argv[1], sys.argv[2:]
    every = load(paths)
    rows = [r for r in every if r.get("bench", "served") == "served"]
    firsts = [r for r in every if r.get("bench") == "served-first"]
    if not rows:
        print("report_served.py: no rows", file=sys.stderr)
        return 1
    os.makedirs(outdir, exist_ok=True)
    with open(os.path.join(outdir, "served.json"), "w") as f:
        json.dump(every, f, indent=1)
    with open(os.path.join(outdir, "served.md"), "w") as f:
        f.write("# kvferryd served STORE / RETRIEVE (%s)\n\n" % rows[0]["date"])
        f.write("Each row: the median over its rounds of payload bytes / wall time for its requests (counts per "
                "row in served.json); ratios are to figures measured in the same run. *in-process*: the median "
                "of single in-process calls (each waited for); *in-process rounds*: rounds of as many in-process "
                "calls one after another, each waited for, measured as the served rounds are (a round's wall "
                "time keeps its slow calls). Rendered by perf/report_served.py.\n\n")
        f.write(table(rows))
        if firsts:
            f.write("\nThe first STORE after a registration against the four after it (one request at a time), "
                    "and against STOREs after 100 ms of idleness (the server's threads asleep, as before the "
                    "first; median of 3): first / after idle near 1 means nothing is set up on first use, and "
                    "what first / later shows beyond it is the wake-up of idle threads:\n\n")
            f.write("| GPU | tokens/request | first STORE ms | next four, median ms | first / later "
                    "| after idle ms | first / after idle |\n")
            f.write("|---:|---:|---:|---:|---:|---:|---:|\n")
            for r in firsts:
                idle = r.get("idle_store_ms_p50")
                f.write("| %d | %d | %.3f | %.3f | %.2fx | %s | %s |\n" % (
                    r["device"], r["tokens_per_request"], r["first_store_ms"], r["later_store_ms_p50"],
                    r["first_over_later"], "%.3f" % idle if idle else "–",
                    "%.2fx" % r["first_over_idle"] if idle else "–"))
    plot(rows, os.path.join(outdir, "served.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
