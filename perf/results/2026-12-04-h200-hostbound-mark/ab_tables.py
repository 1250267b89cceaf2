#!/usr/bin/env python3
"""Markdown tables of the hostbound step's on/off A/B (run_issue15.sh --steps hostbound).

Usage: ab_tables.py TITLE DIR [TITLE DIR ...] > tables.md
DIR holds hostbound-{1,2}.json and hostbound-latency-{1,2}.json from kvf_bench.
"""
import json
import sys


def load(path):
    with open(path) as f:
        return [r for r in json.load(f)["results"] if r.get("kind") in ("transfer", "latency")]


def route(k):
    p = k["path"]
    return p["name"] + (" hb" if p.get("host_bound") else "")


def per_call_table(rows):
    out = ["| chunk | dir | cap | memcpy | batch per call / back to back | on: route, per call, back to back, x batch b2b "
           "| off: per call, back to back, x batch b2b |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lim, bat = r["baselines"]["limit"], r["baselines"]["batch"]
        off = next((k for k in r["kvferry"] if k.get("tune") == "batch_host_bound=0"), None)
        for k in r["kvferry"]:
            if k.get("tune"):
                continue
            offs = "-"
            if off and k["sms_cap"] == 0:
                offs = f'{off["median_us"]:.1f}, {off["sustained_us"]:.1f}, {bat["sustained_us"] / off["sustained_us"]:.3f}'
            out.append(f'| {r["preset"]} | {r["direction"]} | {k["sms_cap_label"]} | {lim["median_us"]:.1f} | '
                       f'{bat["median_us"]:.1f} / {bat["sustained_us"]:.1f} | {route(k)}, {k["median_us"]:.1f}, '
                       f'{k["sustained_us"]:.1f}, {bat["sustained_us"] / k["sustained_us"]:.3f} | {offs} |')
    return out


def latency_rows(rows, rnd):
    out = []
    for r in rows:
        m, on = r["memcpy_same_bytes"]["wall_us"], r["kvferry"]
        off = next(v["kvferry"] for v in r["variants"] if v["tune"] == "batch_host_bound=0")
        out.append(f'| {r["preset"]} | {r["direction"]} | {rnd} | {m:.1f} | {on["wall_us"]:.1f} ({on["wall_us"] / m:.3f}x, '
                   f'enqueue {on["enqueue_us"]:.0f}) | {off["wall_us"]:.1f} ({off["wall_us"] / m:.3f}x, '
                   f'enqueue {off["enqueue_us"]:.0f}) |')
    return out


def main(args):
    for title, d in zip(args[::2], args[1::2]):
        for rnd in (1, 2):
            print(f"\n## {title}, round {rnd}\n")
            print("\n".join(per_call_table(load(f"{d}/hostbound-{rnd}.json"))))
        print(f"\n### {title}: one call alone (wall time, x memcpy of the same bytes)\n")
        print("| chunk | dir | round | memcpy | on | off |\n|---|---|---|---|---|---|")
        for rnd in (1, 2):
            print("\n".join(latency_rows(load(f"{d}/hostbound-latency-{rnd}.json"), rnd)))


if __name__ == "__main__":
    main(sys.argv[1:])
