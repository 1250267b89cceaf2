#!/usr/bin/env python3
"""Tables of this folder's runs (NOTES.md cites them).

    python3 tables.py ab DIR        per-call % of memcpy by (preset, tokens) and round,
                                    each --tune variant's mean difference from the default
    python3 tables.py window DIR    the same rows sorted by payload, for one variant against
                                    the default (--variant, default spread_deep_kb=0)
    python3 tables.py deferred DIR  kvferry rows of kvf_bench JSON whose calls ran deferred
                                    though their variant did not ask (the bench defect 5683951 fixed)

DIR's ab-*.json or sweep-*.json (ab, window) or chunk-*.json (deferred) are read, .gz or not.
"""
import argparse
import gzip
import json
import statistics
from pathlib import Path


def load(path):
    """One kvf_bench JSON, gzipped or not."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def runs_of(folder, patterns):
    """The JSON files of a folder matching any of patterns, sorted."""
    found = []
    for pattern in patterns:
        found += sorted(Path(folder).glob(pattern))
    return found


def d2d_rows(doc):
    """(preset, tokens) -> (payload bytes, {variant: % of memcpy}) for one run's d2d rows."""
    out = {}
    for r in doc["results"]:
        if r.get("kind") != "transfer" or r.get("direction") != "d2d" or "limit" not in r.get("baselines", {}):
            continue
        limit = r["baselines"]["limit"]["median_us"]
        shares = {(k.get("tune") or "default"): 100 * limit / k["median_us"] for k in r["kvferry"] if k.get("median_us")}
        out[(r["preset"], r["tokens"])] = (r["payload_bytes"], shares)
    return out


def ab(folder):
    runs = [d2d_rows(load(p)) for p in runs_of(folder, ["ab-*.json*", "sweep-*.json*"])]
    runs = [r for r in runs if r]
    labels = list(next(iter(runs[0].values()))[1].keys())
    print("| preset | tokens | " + " | ".join(labels) + " |")
    print("|---|---:|" + "---|" * len(labels))
    diffs = {label: {"below": [], "above": []} for label in labels[1:]}
    for key in sorted(runs[0]):
        cells = []
        for label in labels:
            values = [r[key][1].get(label) for r in runs if key in r]
            values = [v for v in values if v is not None]
            cell = " / ".join(f"{v:.1f}" for v in values)
            if label != "default":
                base = [r[key][1]["default"] for r in runs if key in r and label in r[key][1]]
                mean = statistics.mean(v - b for v, b in zip(values, base))
                diffs[label]["below" if key[1] < 4096 else "above"].append(mean)
                cell += f" ({mean:+.2f})"
            cells.append(cell)
        print(f"| {key[0]} | {key[1]} | " + " | ".join(cells) + " |")
    for label, sides in diffs.items():
        for side, values in sides.items():
            if values:
                print(f"{label} {'<4096' if side == 'below' else '>=4096'}: mean {statistics.mean(values):+.2f}, "
                      f"min {min(values):+.2f}, max {max(values):+.2f} over {len(values)} rows")


def window(folder, variant):
    runs = [d2d_rows(load(p)) for p in runs_of(folder, ["ab-*.json*", "sweep-*.json*"])]
    keys = sorted(runs[0], key=lambda k: runs[0][k][0])
    print(f"| payload MiB | preset | tokens | default | {variant} - default (mean; min, max) |")
    print("|---:|---|---:|---:|---|")
    for key in keys:
        pairs = [(r[key][1]["default"], r[key][1][variant]) for r in runs
                 if key in r and "default" in r[key][1] and variant in r[key][1]]
        if not pairs:
            continue
        d = [v - b for b, v in pairs]
        print(f"| {runs[0][key][0] / 2**20:.2f} | {key[0]} | {key[1]} | {statistics.mean(b for b, _ in pairs):.2f} | "
              f"{statistics.mean(d):+.2f} ({min(d):+.2f}, {max(d):+.2f}) |")


def deferred(folder):
    for path in runs_of(folder, ["chunk-*.json*"]):
        doc = load(path)
        bad, total = [], 0
        for r in doc["results"]:
            for k in r.get("kvferry", []):
                if "defer=1" in (k.get("tune") or ""):
                    continue
                total += 1
                if k.get("path", {}).get("deferred"):
                    bad.append(f"{r['preset']} {r['direction']} cap {k.get('sms_cap_label')}")
        print(f"{path.name}: {len(bad)} of {total} direct rows ran deferred" + (": " + "; ".join(bad) if bad else ""))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("table", choices=["ab", "window", "deferred"])
    parser.add_argument("folder")
    parser.add_argument("--variant", default="spread_deep_kb=0")
    args = parser.parse_args()
    if args.table == "ab":
        ab(args.folder)
    elif args.table == "window":
        window(args.folder, args.variant)
    else:
        deferred(args.folder)


if __name__ == "__main__":
    main()
