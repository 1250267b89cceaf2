#!/usr/bin/env python3
"""Tables of this folder's device-to-device A/B runs (kvf_bench JSON): % of a
contiguous memcpy of the same bytes per call, for the default and each
`--tune` variant, every round, with each variant's mean difference from the
default; `sustained` the same for calls back to back (sustained_us).

    python3 tables.py dense|deep|sustained|default
"""
import gzip
import json
import statistics
import sys
from pathlib import Path

here = Path(__file__).resolve().parent


def rows(path, field):
    """(preset, tokens) -> {variant: % of memcpy} for one kvf_bench JSON."""
    out = {}
    for r in json.loads(gzip.open(path).read())["results"]:
        if r.get("kind") != "transfer" or "limit" not in r.get("baselines", {}):
            continue
        limit = r["baselines"]["limit"]
        lim = limit.get(field) or limit["median_us"]
        out[(r["preset"], r["tokens"])] = {(k.get("tune") or "default"): 100 * lim / k[field]
                                           for k in r["kvferry"] if k.get(field)}
    return out


def table(folder, field):
    runs = [rows(p, field) for p in sorted((here / folder).glob("*.json.gz"))]
    labels = list(next(iter(runs[0].values())).keys())
    print("| preset | tokens | " + " | ".join(labels) + " |")
    print("|---|---:|" + "---|" * len(labels))
    diffs = {l: [] for l in labels[1:]}
    for key in runs[0]:
        base = statistics.mean(r[key]["default"] for r in runs)
        cells = []
        for l in labels:
            vals = [r[key][l] for r in runs]
            cell = " / ".join(f"{v:.1f}" for v in vals)
            if l != "default":
                d = statistics.mean(vals) - base
                cell += f" ({d:+.2f})"
                diffs[l].append((key[1], d))
            cells.append(cell)
        print(f"| {key[0]} | {key[1]} | " + " | ".join(cells) + " |")
    print()
    for l, d in diffs.items():
        for big in (False, True):
            sel = [v for (tokens, v) in d if (tokens >= 4096) == big]
            if sel:
                print(f"- {l}, {'4096 tokens and more' if big else 'one chunk'}: mean {statistics.mean(sel):+.2f} "
                      f"points, from {min(sel):+.2f} to {max(sel):+.2f} ({len(sel)} rows)")


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "deep"
    if which in ("sustained", "default"):
        print("Per call:\n")
        table(which, "median_us")
        print("\nBack to back (sustained):\n")
        table(which, "sustained_us")
    else:
        table(which, "median_us")
