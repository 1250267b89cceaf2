#!/usr/bin/env python3
"""Cut a kvf_trace timeline (perf/kvf_trace.c) into calls and say where each
call's GPU time goes.

    trace_calls.py TRACE.csv[.gz] [--first-bytes N | --gap-us 30] [--detail N] [--min-bytes B]

A call is the work from one copy of exactly --first-bytes bytes (a call's
first copy: kvf_bench queues its per-call reps back to back, with only
events between them) to the next, or, without --first-bytes (latency mode,
where every call is synchronized), work separated by an idle GPU for more
than --gap-us. kvf_bench's own kernels (k_spin, k_fill) are left out. For each call:
its span from the first operation's start to the last one's end, the time no operation ran (idle), and, for --detail calls
(the fastest and the slowest), every operation with its start, length and
stream, and the API call that enqueued it (its host start and end).
"""
import argparse
import csv
import gzip
import statistics
import sys


def read(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = list(csv.DictReader(f))
    gpu, api = [], {}
    for r in rows:
        r["start_ns"], r["end_ns"] = int(r["start_ns"]), int(r["end_ns"])
        r["bytes"] = int(r["bytes"] or 0)
        if r["kind"] in ("kernel", "memcpy", "memset"):
            gpu.append(r)
        else:
            # Runtime and driver records share correlation ids; keep the outer (runtime) one.
            c = r["correlation"]
            if c not in api or r["kind"] == "runtime":
                api[c] = r
    gpu.sort(key=lambda r: r["start_ns"])
    return gpu, api


def is_bench_kernel(r):
    return r["kind"] == "kernel" and ("k_spin" in r["name"] or "k_fill" in r["name"])


def calls_of(gpu, gap_ns, first_bytes):
    calls, cur, begin = [], [], None
    last_end = None
    for r in gpu:
        if is_bench_kernel(r):
            continue
        starts = (r["kind"] == "memcpy" and r["bytes"] == first_bytes if first_bytes
                  else last_end is not None and r["start_ns"] - last_end > gap_ns)
        if starts and cur:
            calls.append((begin, cur))
            cur, begin = [], None
        if begin is None:
            begin = r["start_ns"]
        cur.append(r)
        last_end = max(last_end or 0, r["end_ns"])
    if cur:
        calls.append((begin, cur))
    return calls


def idle_ns(begin, ops):
    """Time from begin to the last end that no operation covered."""
    t, idle = begin, 0
    for r in sorted(ops, key=lambda r: r["start_ns"]):
        if r["start_ns"] > t:
            idle += r["start_ns"] - t
        t = max(t, r["end_ns"])
    return idle


def shape(ops):
    k = sum(1 for r in ops if r["kind"] == "kernel")
    m = sum(1 for r in ops if r["kind"] == "memcpy")
    b = sum(r["bytes"] for r in ops if r["kind"] == "memcpy")
    return k, m, b


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--gap-us", type=float, default=30.0)
    ap.add_argument("--first-bytes", type=int, default=0, help="a copy of exactly this many bytes starts a call")
    ap.add_argument("--detail", type=int, default=2, help="calls shown op by op at each end")
    ap.add_argument("--min-bytes", type=int, default=0, help="only calls moving at least this many bytes")
    ap.add_argument("--max-ops", type=int, default=40, help="operations shown per detailed call")
    a = ap.parse_args()
    gpu, api = read(a.trace)
    calls = [(b, ops) for b, ops in calls_of(gpu, int(a.gap_us * 1000), a.first_bytes) if shape(ops)[2] >= a.min_bytes]
    if not calls:
        print("no calls")
        return 1
    groups = {}
    for b, ops in calls:
        groups.setdefault(shape(ops), []).append((b, ops))
    for key, cs in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        spans = [max(r["end_ns"] for r in ops) - b for b, ops in cs]
        idles = [idle_ns(b, ops) for b, ops in cs]
        print(f"== {len(cs)} calls of {key[0]} kernels, {key[1]} copy records, {key[2]} bytes: span median "
              f"{statistics.median(spans)/1e3:.1f} us (min {min(spans)/1e3:.1f}, max {max(spans)/1e3:.1f}), "
              f"idle median {statistics.median(idles)/1e3:.1f} us")
        order = sorted(range(len(cs)), key=lambda i: spans[i])
        if a.detail <= 0:
            picks = []
        elif len(order) > 2 * a.detail:
            picks = order[: a.detail] + order[-a.detail:]
        else:
            picks = order
        for i in picks:
            b, ops = cs[i]
            print(f"  call span {spans[i]/1e3:.1f} us, idle {idles[i]/1e3:.1f} us")
            for r in sorted(ops, key=lambda r: r["start_ns"])[: a.max_ops]:
                h = api.get(r["correlation"])
                host = (f" <- {h['name']} host {(h['start_ns']-b)/1e3:+.1f}..{(h['end_ns']-b)/1e3:+.1f}"
                        if h else "")
                copies = f" in {r['copies']} copies" if r.get("copies") and r["copies"] not in ("", "1") else ""
                what = r["name"][:40] if r["kind"] == "kernel" else f"{r['copy_kind']} {r['bytes']}{copies}"
                print(f"    {r['kind']:6} s{r['stream']:<4} {(r['start_ns']-b)/1e3:8.1f} +{(r['end_ns']-r['start_ns'])/1e3:7.1f} us  {what}{host}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
