#!/usr/bin/env python3
"""Per (preset, tokens) d2d % of memcpy for each kvf_bench variant build (ab-<variant>-<round>.json),
and each variant's mean difference from h0 by round pairs."""
import glob, json, gzip, statistics, sys, re
from collections import defaultdict
folder = sys.argv[1]
share = defaultdict(lambda: defaultdict(list))  # (preset,tokens) -> variant -> [per round]
payload = {}
for path in sorted(glob.glob(folder + "/ab-*-*.json*")):
    m = re.search(r"ab-(h\d)-(\d)\.json", path)
    v = m.group(1)
    doc = json.load((gzip.open if path.endswith(".gz") else open)(path, "rt"))
    for r in doc["results"]:
        if r.get("kind") != "transfer" or r.get("direction") != "d2d":
            continue
        lim = r["baselines"]["limit"]["median_us"]
        k = [k for k in r["kvferry"] if not k.get("tune")][0]
        share[(r["preset"], r["tokens"])][v].append(100 * lim / k["median_us"])
        payload[(r["preset"], r["tokens"])] = r["payload_bytes"]
variants = sorted({v for d in share.values() for v in d})
print("| preset | tokens | MiB | " + " | ".join(variants) + " |")
print("|---|---:|---:|" + "---|" * len(variants))
diffs = defaultdict(lambda: defaultdict(list))
for key in sorted(share, key=lambda k: payload[k]):
    row = share[key]
    cells = []
    for v in variants:
        vals = row.get(v, [])
        cell = " / ".join(f"{x:.1f}" for x in vals)
        if v != "h0" and vals and row.get("h0"):
            d = statistics.mean(vals) - statistics.mean(row["h0"])
            diffs[v]["<4096" if key[1] < 4096 else ">=4096"].append(d)
            cell += f" ({d:+.2f})"
        cells.append(cell)
    print(f"| {key[0]} | {key[1]} | {payload[key]/2**20:.1f} | " + " | ".join(cells) + " |")
for v, sides in diffs.items():
    for side, vals in sides.items():
        print(f"{v} {side}: mean {statistics.mean(vals):+.2f}, min {min(vals):+.2f}, max {max(vals):+.2f} over {len(vals)} rows")
