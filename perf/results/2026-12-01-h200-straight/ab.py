#!/usr/bin/env python3
"""The straight part's A/B from straight-2.json: a markdown table (ab.md) and a
plot (ab.png) of kvferry's share of memcpy per preset, direction and size,
with no straight part, 1 MiB and 2 MiB at the default SM cap, and none, 1, 2
and 4 MiB at 4 SMs (the run's default was 1 MiB at both caps; the library's
default since is 1 MiB, 2 MiB under a cap below 64 SMs). Usage: ab.py [DIR] (default: this script's folder)."""
import json
import os
import sys

here = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
data = json.load(open(os.path.join(here, "straight-2.json")))
cols = [("default", "straight_kb=0", "none"), ("default", "default", "1 MiB"), ("default", "straight_kb=2048", "2 MiB"),
        ("4", "straight_kb=0,cap=4", "4 SMs: none"), ("4", "default", "4 SMs: 1 MiB"),
        ("4", "straight_kb=2048,cap=4", "4 SMs: 2 MiB"), ("4", "straight_kb=4096,cap=4", "4 SMs: 4 MiB")]
rows = []
for r in data["results"]:
    if r.get("kind") != "transfer":
        continue
    got = {(k["sms_cap_label"], k.get("tune", "default")): k for k in r["kvferry"]}
    vals = [100 * got[(c, t)]["vs_limit"] if (c, t) in got else float("nan") for c, t, _ in cols]
    runs = got[("default", "default")]["path"].get("straight_runs", 0)
    rows.append((r["preset"], r["direction"], r["tokens"], vals, runs))
m = data["meta"]
with open(os.path.join(here, "ab.md"), "w") as f:
    f.write(f"# Straight part A/B ({m['date']}, {m['gpu']}, commit {m['git_commit']})\n\n")
    f.write("kvferry's share of a memcpy of the same bytes (GPU time, medians). The run's default was 1 MiB "
            "at both caps; the committed default is 1 MiB, 2 MiB under an SM cap below 64.\n\n")
    f.write("| preset | dir | tokens | " + " | ".join(c[2] for c in cols) + " | straight runs |\n")
    f.write("|---|---|---|" + "---|" * len(cols) + "---|\n")
    for p, d, t, v, n in rows:
        f.write(f"| {p} | {d} | {t} | " + " | ".join(f"{x:.1f}" for x in v) + f" | {n} |\n")
try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    sys.exit(0)
one = [x for x in rows if x[2] < 1000]
fig, axes = plt.subplots(2, 1, figsize=(14, 8), sharex=True)
for ax, (lo, hi, title) in zip(axes, [(0, 3, "default SM cap"), (3, 7, "4-SM cap")]):
    w = 0.8 / (hi - lo)
    for i, k in enumerate(range(lo, hi)):
        ax.bar([j + (i - (hi - lo - 1) / 2) * w for j in range(len(one))], [x[3][k] for x in one], w, label=cols[k][2])
    ax.axhline(95 if lo == 0 else 90, color="k", lw=0.8, ls="--")
    ax.set_ylim(60, 101)
    ax.set_ylabel("% of memcpy")
    ax.set_title(f"one chunk, {title}")
    ax.legend(loc="lower left", fontsize=8)
axes[1].set_xticks(range(len(one)))
axes[1].set_xticklabels([f"{p[:18]} {d}" for p, d, _, _, _ in one], rotation=70, fontsize=7)
fig.suptitle(f"staged route's straight part, {m['gpu']}, {m['date'][:10]}")
fig.tight_layout()
fig.savefig(os.path.join(here, "ab.png"), dpi=110)
