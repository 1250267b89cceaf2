#!/usr/bin/env python3
"""The device-to-device kernel's A/B from ab-run-a.json, ab-run-b.json and
ab-run-c.json (three runs of run_issue15.sh's d2d-ab step; b and c on the
committed kernels, c after the review's fixes): a
markdown table (ab.md) and a plot (ab.png) of kvferry's share of memcpy per
preset and size with the committed defaults (spread launches from 8 MiB,
head-major gathers in cache order), without either (one CTA per SM, the
object's order: the previous defaults), without the spread and without the
cache order. Usage: ab.py [DIR] (default: this script's folder)."""
import json
import os
import sys

here = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
cols = [("default", "spread + cache order"), ("spread_kb=0,cache_order=0", "neither (previous)"),
        ("spread_kb=0", "no spread"), ("cache_order=0", "no cache order")]


def rows_of(name):
    data = json.load(open(os.path.join(here, name)))
    out = {}
    for r in data["results"]:
        if r.get("kind") != "transfer":
            continue
        got = {k.get("tune", "default"): k for k in r["kvferry"]}
        lim = r["baselines"]["limit"]["median_us"]
        out[(r["preset"], r["tokens"])] = ([100 * lim / got[t]["median_us"] for t, _ in cols], r["payload_bytes"])
    return data["meta"], out


meta_a, a = rows_of("ab-run-a.json")
meta_b, b = rows_of("ab-run-b.json")
meta_c, c = rows_of("ab-run-c.json")
keys = sorted(b, key=lambda k: (k[1] >= 4096, k[0]))
with open(os.path.join(here, "ab.md"), "w") as f:
    f.write(f"# Device-to-device kernel A/B ({meta_b['date']}, {meta_b['gpu']}, {meta_b['sm_count']} SMs, "
            f"driver {meta_b['driver_version']})\n\n")
    f.write("kvferry's share of a contiguous memcpy of the same bytes in the same run (GPU time, medians; "
            f"runs b / a / c: commits {meta_b['git_commit']} / {meta_a['git_commit']} / {meta_c['git_commit']}, "
            "the same kernels; c spreads only device-to-device launches, which these all are). "
            "Target: 85% below 4096 tokens, 92% at 4096 and above.\n\n")
    f.write("| preset | tokens | MiB | " + " | ".join(f"{col[1]} (b / a / c)" for col in cols) + " |\n")
    f.write("|---|---|---|" + "---|" * len(cols) + "\n")
    for k in keys:
        vb, size = b[k]
        va = a.get(k, ([float("nan")] * len(cols), 0))[0]
        vc = c.get(k, ([float("nan")] * len(cols), 0))[0]
        f.write(f"| {k[0]} | {k[1]} | {size / 2**20:.1f} | " +
                " | ".join(f"{x:.1f} / {y:.1f} / {z:.1f}" for x, y, z in zip(vb, va, vc)) + " |\n")
try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    sys.exit(0)
fig, axes = plt.subplots(2, 1, figsize=(14, 8), sharey=True)
for ax, big in zip(axes, (False, True)):
    ks = [k for k in keys if (k[1] >= 4096) == big]
    w = 0.8 / len(cols)
    for i, (_, label) in enumerate(cols):
        ax.bar([j + (i - (len(cols) - 1) / 2) * w for j in range(len(ks))], [b[k][0][i] for k in ks], w, label=label)
    ax.axhline(92 if big else 85, color="k", lw=0.8, ls="--")
    ax.set_ylim(60, 104)
    ax.set_ylabel("% of memcpy")
    ax.set_title(f"device to device, {'4096 tokens' if big else 'one chunk'} (run b)")
    ax.set_xticks(range(len(ks)))
    ax.set_xticklabels([k[0] for k in ks], rotation=30, ha="right", fontsize=7)
    ax.legend(loc="upper center", ncol=4, fontsize=8)
fig.tight_layout()
fig.savefig(os.path.join(here, "ab.png"), dpi=90)
