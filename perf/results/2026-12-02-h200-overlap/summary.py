#!/usr/bin/env python3
"""Tables and a plot of the overlap and compact-blob runs (run-a: dba42ba,
overlap on every parameter launch of a d2d call, blobs of 160-byte entries;
run-b: dfe7cf3, the committed code: overlap only on overlapped launches,
64-byte entries and shared shapes, 4/6 KiB parameter variants).

ab.md / ab.png: device to device, every preset, one chunk and 4096 tokens:
kvferry's share of memcpy per call (events around each call: an event
between calls ends any overlap) and sustained (calls back to back from one
thread, host enqueue charged, against memcpy's sustained rate), with the
overlap (default) and without it (overlap=0), and the defaults before the
spread and the cache order. chunk.md: one chunk, every preset and
direction: share of memcpy and host enqueue alone, run-a against run-b.
waves.md: run-d's A/B of KVF_XFER_DEVICE_TASK_WAVES (2 against 4).
Usage: summary.py [DIR] (default: this script's folder)."""
import json
import os
import sys

here = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
tunes = [("default", "overlap"), ("overlap=0", "no overlap"), ("spread_kb=0,cache_order=0,overlap=0", "before spread")]


def load(path):
    data = json.load(open(os.path.join(here, path)))
    return data["meta"], [r for r in data["results"] if r.get("kind") == "transfer"]


def ab_rows(path):
    meta, rows = load(path)
    out = {}
    for r in rows:
        lim = r["baselines"]["limit"]
        got = {k.get("tune", "default"): k for k in r["kvferry"]}
        per_call = [100 * lim["median_us"] / got[t]["median_us"] for t, _ in tunes]
        sustained = [100 * lim["sustained_us"] / got[t]["sustained_us"] for t, _ in tunes]
        out[(r["preset"], r["tokens"])] = (per_call, sustained)
    return meta, out


meta_a, a = ab_rows("run-a/d2d-ab.json")
meta_b, b = ab_rows("run-b/d2d-ab.json")
keys = sorted(b, key=lambda k: (k[1] >= 4096, k[0]))
with open(os.path.join(here, "ab.md"), "w") as f:
    f.write(f"# Device to device: overlapped launches and compact blobs ({meta_b['date']}, {meta_b['gpu']}, "
            f"{meta_b['sm_count']} SMs, driver {meta_b['driver_version']})\n\n")
    f.write("kvferry's share of a contiguous memcpy of the same bytes, same run, medians. *Per call*: events "
            "around each call (an event between two calls ends the overlap, so the overlap cannot show here). "
            "*Sustained*: calls back to back from one thread, host enqueue charged, against memcpy's own "
            f"sustained rate. Run b: commit {meta_b['git_commit']} (committed code); run a: {meta_a['git_commit']} "
            "(overlap, 160-byte entries).\n\n")
    f.write("| preset | tokens | per call b: overlap / none / before spread | sustained b: overlap / none / before spread "
            "| sustained a: overlap / none |\n|---|---|---|---|---|\n")
    for k in keys:
        pb, sb = b[k]
        pa, sa = a.get(k, ([float("nan")] * 3, [float("nan")] * 3))
        f.write(f"| {k[0]} | {k[1]} | {pb[0]:.1f} / {pb[1]:.1f} / {pb[2]:.1f} | **{sb[0]:.1f}** / {sb[1]:.1f} / "
                f"{sb[2]:.1f} | {sa[0]:.1f} / {sa[1]:.1f} |\n")


def chunk_rows(path):
    meta, rows = load(path)
    out = {}
    for r in rows:
        for k in r["kvferry"]:
            if k.get("tune"):
                continue
            out[(r["preset"], r["direction"], k.get("sms_cap_label"))] = (100 * k["vs_limit"], k["enqueue_alone_us"])
    return meta, out


ma, ca = chunk_rows("run-a/chunk-256.json")
mb, cb = chunk_rows("run-b/chunk-256.json")
with open(os.path.join(here, "chunk.md"), "w") as f:
    f.write(f"# One chunk, run a ({ma['git_commit']}) against run b ({mb['git_commit']}), {mb['gpu']}\n\n")
    f.write("kvferry's share of memcpy (GPU time per call, medians) and host enqueue of a call alone "
            "(median of 9, µs), default tuning.\n\n| preset | direction | SM cap | % of memcpy a | b | enqueue µs a | b |\n"
            "|---|---|---|---|---|---|---|\n")
    for k in sorted(cb):
        va, ea = ca.get(k, (float("nan"), float("nan")))
        vb, eb = cb[k]
        f.write(f"| {k[0]} | {k[1]} | {k[2]} | {va:.1f} | {vb:.1f} | {ea:.1f} | {eb:.1f} |\n")


def waves_table():
    """waves.md: run-d's device_task_waves A/B (2, the default, against 4)."""
    meta, rows = load("run-d/d2d-waves.json")
    with open(os.path.join(here, "waves.md"), "w") as f:
        f.write(f"# Device to device: tasks per warp, 2 (default) against 4 ({meta['date']}, {meta['gpu']}, "
                f"commit {meta['git_commit']})\n\nkvferry's share of memcpy, same run, medians: per call (events) "
                "and sustained (back to back, host enqueue charged); host enqueue of a call alone (µs).\n\n"
                "| preset | tokens | per call 2 / 4 | sustained 2 / 4 | enqueue µs |\n|---|---|---|---|---|\n")
        for r in rows:
            lim = r["baselines"]["limit"]
            k = {x.get("tune", "default"): x for x in r["kvferry"]}
            a, b = k["default"], k["device_task_waves=4"]
            f.write(f"| {r['preset']} | {r['tokens']} | **{100 * lim['median_us'] / a['median_us']:.1f}** / "
                    f"{100 * lim['median_us'] / b['median_us']:.1f} | {100 * lim['sustained_us'] / a['sustained_us']:.1f} / "
                    f"{100 * lim['sustained_us'] / b['sustained_us']:.1f} | {a['enqueue_alone_us']:.1f} |\n")


waves_table()

try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    sys.exit(0)
fig, axes = plt.subplots(1, 2, figsize=(15, 6), sharey=True)
for ax, tokens_big in zip(axes, (False, True)):
    ks = [k for k in keys if (k[1] >= 4096) == tokens_big]
    x = range(len(ks))
    w = 0.2
    series = [("per call, overlap", [b[k][0][0] for k in ks]), ("sustained, no overlap", [b[k][1][1] for k in ks]),
              ("sustained, overlap", [b[k][1][0] for k in ks]), ("sustained, before spread", [b[k][1][2] for k in ks])]
    for i, (label, vals) in enumerate(series):
        ax.bar([xi + (i - 1.5) * w for xi in x], vals, w, label=label)
    ax.axhline(92 if tokens_big else 85, color="k", lw=0.8, ls="--")
    ax.set_xticks(list(x))
    ax.set_xticklabels([k[0] for k in ks], rotation=60, ha="right", fontsize=7)
    ax.set_title("4096 tokens" if tokens_big else "one chunk")
    ax.set_ylim(40, 110)
axes[0].set_ylabel("% of memcpy (same run)")
axes[1].legend(fontsize=8)
fig.suptitle(f"d2d, {meta_b['gpu']}, {meta_b['date']}, commit {meta_b['git_commit']}")
fig.tight_layout()
fig.savefig(os.path.join(here, "ab.png"), dpi=110)
