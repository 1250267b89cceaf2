#!/usr/bin/env python3
"""Tables and a plot of this folder's runs (see NOTES.md): walk.md and walk.png
(the walk's start, per call, one chunk and 4096 tokens), ramp.md (the batch
API's ramped calls: latency and GPU time) and probe.md (plain copy kernels
against memcpy, and Nsight Compute's view of both kernels).

Usage: python3 summary.py  (from anywhere; reads and writes next to itself)
"""
import json
import re
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent


def transfers(path):
    """(preset, tokens, direction, tune) -> the first kvferry entry of each transfer row."""
    rows = {}
    for r in json.loads(path.read_text())["results"]:
        if r.get("kind") != "transfer":
            continue
        for k in r["kvferry"]:
            key = (r["preset"], r["tokens"], r["direction"], k.get("tune", ""), k.get("sms_cap_label", ""))
            rows[key] = k
    return rows


def per_call(path, cap="default"):
    """(preset, tokens) -> % of memcpy per call, d2d rows of the default tuning."""
    return {(p, t): 100 * k["vs_limit"] for (p, t, d, tune, c), k in transfers(path).items()
            if d == "d2d" and tune == "" and c == cap}


def mean_of(paths):
    runs = [per_call(p) for p in paths]
    return {key: statistics.mean(r[key] for r in runs) for key in runs[0]}


def walk():
    old = mean_of([HERE / f"walk/run7/d2d-old-{i}.json" for i in (1, 2)])
    lin = mean_of([HERE / f"walk/run7/d2d-lin-{i}.json" for i in (1, 2)])
    gen = mean_of([HERE / f"walk/run7/d2d-new-{i}.json" for i in (1, 2)])
    fix = mean_of([HERE / f"walk/run8/d2d-fix-{i}.json" for i in (1, 2)])
    lin8 = mean_of([HERE / f"walk/run8/d2d-lin-{i}.json" for i in (1, 2)])
    fin = per_call(HERE / "run10-4438005/d2d-ab.json")
    out = ["# The walk's start: device to device per call, % of memcpy (NVIDIA H200, 2026-12-02)", "",
           "Run 7 (three builds alternated twice in one session, means of the two): before (e00c93c), "
           "no division to a lone task or a first-chunk object plus a linear gather's prefetch "
           "(`lin`), and the prefetch for every gather in the walk's order computed before the "
           "object (`all`). Run 8: `lin` against the committed walk (4438005: linear gathers as "
           "`lin` without a division, the others as `all`), alternated twice, means. `final`: the "
           "committed walk in run 10's d2d-ab step (a separate process).", "",
           "| preset | tokens | before (7) | lin (7) | all (7) | lin (8) | committed (8) | final (10) | final - before |",
           "|---|---|---|---|---|---|---|---|---|"]
    for key in sorted(old):
        f = fin.get(key)
        fs = f"{f:.1f}" if f is not None else "–"
        d = f"{f - old[key]:+.1f}" if f is not None else "–"
        out.append(f"| {key[0]} | {key[1]} | {old[key]:.1f} | {lin[key]:.1f} | {gen[key]:.1f} | {lin8[key]:.1f} | "
                   f"{fix[key]:.1f} | {fs} | {d} |")
    (HERE / "walk.md").write_text("\n".join(out) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    keys = sorted(k for k in old if k[1] < 4096)
    x = range(len(keys))
    fig, ax = plt.subplots(figsize=(12, 4.5))
    w = 0.2
    for i, (name, d) in enumerate([("before (run 7)", old), ("lin (run 7)", lin), ("all (run 7)", gen),
                                   ("committed (run 8)", fix)]):
        ax.bar([v + (i - 1.5) * w for v in x], [d.get(k, 0) for k in keys], w, label=name)
    ax.axhline(85, color="k", lw=0.8, ls="--")
    ax.set_xticks(list(x))
    ax.set_xticklabels([k[0].replace("llama-3.1-", "").replace("deepseek-v3-", "") for k in keys], rotation=35,
                       ha="right", fontsize=8)
    ax.set_ylim(60, 95)
    ax.set_ylabel("% of memcpy, per call")
    ax.set_title("One chunk device to device per call, NVIDIA H200, 2026-12-02 (dashed: the 85% target)")
    ax.legend(ncol=4, fontsize=8)
    fig.tight_layout()
    fig.savefig(HERE / "walk.png", dpi=110)


def latency_rows(path):
    rows = {}
    for r in json.loads(path.read_text())["results"]:
        if r.get("kind") != "latency":
            continue
        k, m = r["kvferry"], r["memcpy_same_bytes"]
        rows[(r["preset"], r["direction"])] = (k["gpu_us"] / m["gpu_us"], k["enqueue_us"])
    return rows


def ramp():
    out = ["# The batch API's ramped calls (NVIDIA H200, 2026-12-02)", "",
           "## Latency: one chunk alone, GPU time of kvferry over memcpy's (enqueue µs)", "",
           "Run 1, one process per KVF_XFER_BATCH_FIRST_RUNS (0: one call); runs 2 and 10: "
           "the default (8, ramped only on an idle stream).", "",
           "| preset | dir | 0 | 4 | 8 | 16 | run 2 | run 10 |", "|---|---|---|---|---|---|---|---|"]
    runs = [latency_rows(HERE / f"ramp/run1/lat-{f}.json") for f in (0, 4, 8, 16)]
    run2 = latency_rows(HERE / "ramp/run2/latency.json")
    fin = latency_rows(HERE / "run10-4438005/latency.json")
    for key in sorted(runs[0]):
        cells = [f"{r[key][0]:.2f}x ({r[key][1]:.0f})" for r in runs]
        for extra in (run2, fin):
            cells.append(f"{extra[key][0]:.2f}x ({extra[key][1]:.0f})" if key in extra else "–")
        out.append(f"| {key[0]} | {key[1]} | " + " | ".join(cells) + " |")
    out += ["", "## GPU time per call behind queued work (% of memcpy): ramped against one call", "",
            "Run 1 ramped every call; run 2 ramps only on an idle stream (cudaStreamQuery), so a queued "
            "call makes one batch call.", "",
            "| preset | dir | run 1 ramped | run 1 one call | run 2 default | run 2 one call |",
            "|---|---|---|---|---|---|"]
    r1 = transfers(HERE / "ramp/run1/ramp-ab.json")
    r2 = transfers(HERE / "ramp/run2/ramp-ab.json")

    def pct(rows, p, d, tune):
        k = rows.get((p, 256, d, tune, "default")) or rows.get((p, 544, d, tune, "default"))
        return f"{100 * k['vs_limit']:.1f}" if k else "–"
    for p in sorted({k[0] for k in r2}):
        for d in ("d2h", "h2d"):
            out.append(f"| {p} | {d} | {pct(r1, p, d, '')} | {pct(r1, p, d, 'batch_first_runs=0')} | "
                       f"{pct(r2, p, d, '')} | {pct(r2, p, d, 'batch_first_runs=0')} |")
    out += ["", "## A small staged request's two pieces, 1:2 against 1:4 (run 2, % of memcpy, default cap)", "",
            "| preset | dir | 1:4 (default) | 1:2 |", "|---|---|---|---|"]
    st = transfers(HERE / "ramp/run2/stage-ab.json")
    for p in sorted({k[0] for k in st}):
        for d in ("d2h", "h2d"):
            a = st.get((p, 256, d, "", "default"))
            b = st.get((p, 256, d, "small_stage_growth=2", "default"))
            if a and b:
                out.append(f"| {p} | {d} | {100 * a['vs_limit']:.1f} | {100 * b['vs_limit']:.1f} |")
    (HERE / "ramp.md").write_text("\n".join(out) + "\n")


def probe():
    out = ["# Plain copy kernels against memcpy, and the walk under Nsight Compute (NVIDIA H200, 2026-12-02)", "",
           "## kvf_copy_probe, per call, % of memcpy (run 3 shapes, run 4 chains of dependent table reads)", ""]
    for run in ("run3", "run4"):
        rows = [json.loads(line) for line in (HERE / f"probe/{run}/copy.jsonl").read_text().splitlines() if line]
        sizes = sorted({r["bytes"] for r in rows})
        whats = list(dict.fromkeys(r["what"] for r in rows if r["what"] != "memcpy"))
        out += [f"{run}:", "", "| kernel | " + " | ".join(f"{s / 1e6:.1f} MB" for s in sizes) + " |",
                "|---|" + "---|" * len(sizes)]
        by = {(r["what"], r["bytes"]): r for r in rows}
        out.append("| memcpy µs | " + " | ".join(f"{by[('cudaMemcpyAsync D2D', s)]['median_us']:.2f}"
                                                if ('cudaMemcpyAsync D2D', s) in by else "–" for s in sizes) + " |")
        for w in whats:
            if w == "cudaMemcpyAsync D2D":
                continue
            cells = []
            for s in sizes:
                r = by.get((w, s))
                cells.append(f"{100 * r['memcpy_us'] / r['median_us']:.1f}" if r else "–")
            out.append(f"| {w} | " + " | ".join(cells) + " |")
        out.append("")
    out += ["## Nsight Compute, one launch each (L2 flushed before it)", "",
            "| kernel | duration µs | instructions | registers | CTAs | wait stall cycles a warp |", "|---|---|---|---|---|---|"]
    for log in sorted((HERE / "probe/ncu").glob("ncu-*.log")):
        text = log.read_text()

        def metric(name):
            m = re.search(rf"{re.escape(name)}\s+\S*\s+([\d,.]+)", text)
            return m.group(1) if m else "–"
        out.append(f"| {log.stem[4:]} | {metric('gpu__time_duration.sum')} | {metric('smsp__inst_executed.sum')} | "
                   f"{metric('launch__registers_per_thread')} | {metric('launch__grid_size')} | "
                   f"{metric('smsp__average_warp_latency_issue_stalled_wait.ratio')} |")
    out += ["", "probe-2740: the probe's 8 KiB-task kernel on 17.99 MB (the MLA chunk); probe-4420: on 33.55 MB "
            "(the Llama chunk). The walk kernels are the one-chunk d2d launches of the presets named."]
    (HERE / "probe.md").write_text("\n".join(out) + "\n")


if __name__ == "__main__":
    walk()
    ramp()
    probe()
