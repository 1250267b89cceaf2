#!/usr/bin/env python3
"""Tables of this folder's device-to-device runs (% of memcpy per call, from
kvf_bench's JSON): the packed-entries A/B (ab/ab-*.json: the default, packed,
against --tune pack=0) and the tuning sweep (probe/tune-*.json)."""
import json
import statistics
import sys
from pathlib import Path

here = Path(__file__).resolve().parent


def rows(path):
    """(preset, tokens) -> {label: % of memcpy} for one kvf_bench JSON."""
    out = {}
    for r in json.loads(path.read_text())["results"]:
        if r.get("kind") != "transfer":
            continue
        limit = r["baselines"]["limit"]["median_us"]
        out[(r["preset"], r["tokens"])] = {
            (k.get("tune") or "default"): (100 * limit / k["median_us"], k["path"].get("packed_launches"))
            for k in r["kvferry"]}
    return out


def ab():
    runs = [rows(p) for p in sorted((here / "ab").glob("ab-*.json"))]
    print("| preset | tokens | packed (rounds) | pack=0 (rounds) | mean difference |")
    print("|---|---:|---|---|---:|")
    for key in runs[0]:
        on = [r[key]["default"][0] for r in runs]
        off = [r[key]["pack=0"][0] for r in runs]
        packed = runs[0][key]["default"][1]
        name = key[0] + ("" if packed else " (does not pack)")
        print(f"| {name} | {key[1]} | {' / '.join(f'{v:.1f}' for v in on)} | "
              f"{' / '.join(f'{v:.1f}' for v in off)} | {statistics.mean(on) - statistics.mean(off):+.2f} |")


def tune():
    runs = [rows(p) for p in sorted((here / "probe").glob("tune-*.json"))]
    labels = list(next(iter(runs[0].values())).keys())
    print("| preset | tokens | " + " | ".join(labels) + " |")
    print("|---|---:|" + "---|" * len(labels))
    for key in runs[0]:
        cells = [" / ".join(f"{r[key][l][0]:.1f}" for r in runs) for l in labels]
        print(f"| {key[0]} | {key[1]} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    (ab if sys.argv[1:] == ["ab"] else tune)()
