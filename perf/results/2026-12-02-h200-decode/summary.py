#!/usr/bin/env python3
"""ab.md and ab.png from this folder's runs (see NOTES.md): device to device
per call and sustained, % of memcpy measured in the same process, for the
walk builds alternated in runs A and B, and the final run's A/B step.

Usage: python3 summary.py  (from anywhere; reads and writes next to itself)
"""
import json
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent


def rows(path):
    """(preset, tokens, tune) -> (% of memcpy per call, % sustained) of each d2d row."""
    out = {}
    for r in json.loads(path.read_text())["results"]:
        if r.get("kind") != "transfer" or r["direction"] != "d2d":
            continue
        limit = r["baselines"]["limit"]
        for k in r["kvferry"]:
            sustained = 100 * k["sustained_gbps"] / limit["sustained_gbps"] if k.get("sustained_gbps") else float("nan")
            out[(r["preset"], r["tokens"], k.get("tune", ""))] = (100 * k["gbps"] / limit["gbps"], sustained)
    return out


def means(run, build):
    """The two rounds' mean of each row of one build in run A or B."""
    rounds = [rows(HERE / run / f"d2d-{build}-{i}.json") for i in (1, 2)]
    return {key: tuple(statistics.mean(r[key][i] for r in rounds) for i in (0, 1)) for key in rounds[0]}


def table(title, note, run, builds, waves=("2 (default then)", "1")):
    data = {b: means(run, b) for b in builds}
    keys = sorted(data[builds[0]])
    out = [f"## {title}", "", note, "",
           "| preset | tokens | tasks per warp | " + " | ".join(builds) + " | sustained: " + " | ".join(builds) + " |",
           "|---|---|---|" + "---|" * (2 * len(builds))]
    for p, t, tune in keys:
        per = " | ".join(f"{data[b][(p, t, tune)][0]:.1f}" for b in builds)
        sus = " | ".join(f"{data[b][(p, t, tune)][1]:.1f}" for b in builds)
        out.append(f"| {p} | {t} | {waves[1] if tune else waves[0]} | {per} | {sus} |")
    return out, data


def main():
    out = ["# The walk's decode: device to device, % of memcpy (NVIDIA H200, 2026-12-02)", "",
           "Per call: CUDA events around each call, median; sustained: calls back to back from one "
           "host thread, host enqueue charged (noisy where the enqueue, 7-13 µs, is as long as the "
           "copy). Each build ran twice, alternated, in one session; the tables give the means. "
           "Every row also ran with the other `device_task_waves` (one or two tasks per warp).", ""]
    a, _ = table("Run A", "base: 95fed08. v1: the wait for the previous grid first in the kernel (no R2UR, a "
                 "third of the copy loop's instructions) and whole linear rounds without predicates. v2: v1 "
                 "and no division for a task's block or its object index.", "runA", ["base", "v1", "v2"])
    b, data_b = table("Run B", "base: 95fed08. v2w: v2's decode with the wait where it was (a warp decodes "
                      "before it waits). v3: v2w, the first chunk's object read with the entry, a task's entry "
                      "by the header's multiplier: committed as 1813e9f.", "runB", ["base", "v2w", "v3"])
    c, _ = table("Run C", "v3: e451513 (committed). v4: a linear gather's first round of loads issued before "
                 "its object is decoded, in place of the L2 prefetch (not committed: -1.4 to -1.8 on MLA, the "
                 "DCP rank, the MLA fp8 cache and the tp4 slice, +0.3 to +1.6 on the Llama layouts).", "runC",
                 ["v3", "v4"], waves=("1 (default)", "2"))
    final = rows(HERE / "run-final-e451513/d2d-ab.json")
    f = ["## Final run (e451513)", "", "`run_issue15.sh`'s d2d-ab step: the committed defaults (one task per "
         "warp), the previous default of two, and `KVF_XFER_SPREAD_KB` at 2 MiB. Per call.", "",
         "| preset | tokens | default | device_task_waves=2 | spread_kb=2048 |", "|---|---|---|---|---|"]
    for p, t in sorted({(p, t) for p, t, _ in final}):
        f.append(f"| {p} | {t} | " + " | ".join(f"{final[(p, t, tune)][0]:.1f}" for tune in
                                                ("", "device_task_waves=2", "spread_kb=2048")) + " |")
    (HERE / "ab.md").write_text("\n".join(out + a + [""] + b + [""] + c + [""] + f) + "\n")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    presets = sorted({p for p, t, _ in data_b["base"] if t < 4096})
    tokens = {p: t for p, t, _ in data_b["base"] if t < 4096}
    series = [("base, 2 tasks a warp (B)", data_b["base"], ""), ("v3, 2 tasks a warp (B)", data_b["v3"], ""),
              ("v3, 1 task a warp (B)", data_b["v3"], "device_task_waves=1")]
    fig, ax = plt.subplots(figsize=(12, 5))
    width = 0.2
    for i, (label, d, tune) in enumerate(series):
        ax.bar([x + i * width for x in range(len(presets))], [d[(p, tokens[p], tune)][0] for p in presets], width,
               label=label)
    ax.bar([x + 3 * width for x in range(len(presets))], [final[(p, tokens[p], "")][0] for p in presets], width,
           label="committed defaults (final run)")
    ax.axhline(85, color="k", lw=0.8, ls="--")
    ax.set_xticks([x + 1.5 * width for x in range(len(presets))])
    ax.set_xticklabels([p.replace("llama-3.1-", "").replace("deepseek-v3-", "") for p in presets], rotation=35,
                       ha="right", fontsize=8)
    ax.set_ylim(60, 95)
    ax.set_ylabel("% of memcpy, per call")
    ax.set_title("One chunk device to device per call, NVIDIA H200, 2026-12-02 (target 85%)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(HERE / "ab.png", dpi=110)


if __name__ == "__main__":
    main()
