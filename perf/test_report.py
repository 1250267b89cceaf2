#!/usr/bin/env python3
"""perf/test_report.py - checks perf/report.py on synthetic kvf_bench output
(no GPU): the target verdicts (planted misses are reported as missed, with
the shortfall), the markdown sections, and the plots when matplotlib is there.
Runs as a script (ctest perf_report) or under pytest.

The synthetic records follow kvf_bench.cu's writer field for field; they are
written to a temporary directory only and are never results."""
import gzip
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402
import report_host_path  # noqa: E402

LIMIT = {"d2h": 54.0, "h2d": 54.5, "d2d": 2100.0, "d2d-scatter": 2100.0}


def timing(gb, payload, sustained=None, **extra):
    """A write_timing record at gb GB/s of GPU time; sustained: GB/s of the sustained pass
    (None: left out, as in JSON from before it)."""
    us = payload / (gb * 1e3)
    t = {"ok": True, "reps": 20, "median_us": us, "p10_us": us * 0.98, "p90_us": us * 1.02, "min_us": us * 0.97,
         "enqueue_us": 5.0, "primed": True, "gbps": gb}
    if sustained is not None:
        t.update(sustained_us=payload / (sustained * 1e3), sustained_reps=20, sustained_gbps=sustained)
    t.update(extra)
    return t


def add_sustained(r, kvf, batch, cub):
    """Give transfer record r sustained figures: kvferry's default entry, batch and cub."""
    payload = r["payload_bytes"]
    for e, gb in ((next(e for e in r["kvferry"] if e["sms_cap"] == 0 and not e.get("tune")), kvf),
                  (r["baselines"]["batch"], batch), (r["baselines"]["cub"], cub)):
        e.update(sustained_us=payload / (gb * 1e3), sustained_reps=20, sustained_gbps=gb)


def transfer(preset, direction, tokens, kvf, small=None, avg_run=32768.0, batch=5.0, cub=None):
    payload = tokens * 131072
    lim = LIMIT[direction]
    entries = [dict(sms_cap=0, sms_cap_label="default", sms_used=8 if direction in ("d2h", "h2d") else 132,
                    route=direction[:3], tasks=100, stats_payload_bytes=payload, **timing(kvf, payload))]
    if small is not None:
        entries.append(dict(sms_cap=4, sms_cap_label="4", sms_used=4, route=direction[:3], tasks=100,
                            stats_payload_bytes=payload, **timing(small, payload)))
    for e in entries:
        e["vs_limit"] = e["gbps"] / lim
    return {
        "kind": "transfer", "preset": preset, "direction": direction,
        "op": "scatter" if direction in ("h2d", "d2d-scatter") else "gather",
        "memory": {"cache": "device", "objects": "pinned_host" if direction in ("d2h", "h2d") else "device"},
        "format": "canonical", "tokens": tokens, "tokens_requested": tokens, "payload_bytes": payload,
        "runs": int(payload / avg_run), "runs_unmerged": int(payload / 256), "avg_run_bytes": avg_run, "objects": tokens // 256,
        "sets": 2, "working_set_bytes": 4 * payload, "cache_bytes": 3 * payload, "num_blocks": 4096,
        "verify": {"ran": True, "ok": True, "compared_bytes": payload, "seconds": 0.1},
        "kvferry": entries,
        "baselines": {
            "limit": timing(lim, payload),
            "memcpy_per_run": dict(timed_runs=100, total_runs=1000, timed_fraction=0.1, extrapolated=True,
                                   **timing(1.5, payload)),
            "batch": dict(timed_runs=1000, total_runs=1000, timed_fraction=1.0, extrapolated=False,
                          **timing(batch, payload)),
            "cub": dict(timed_runs=1000, **timing(cub if cub is not None else lim * 0.85, payload)),
        },
    }


def synthetic(directory):
    meta = {"date": "2026-11-29T12:00:00Z", "host": "test", "gpu": "NVIDIA H200", "gpu_pci_bus_id": "0000:00:00.0",
            "device": 0, "sm_count": 132, "l2_bytes": 62914560, "memory_bytes": 150000000000,
            "compute_capability": "9.0", "device_count": 1, "peer_device": -1, "peer_access": False,
            "peer_reason": "needs a second GPU (1 visible)", "driver_version": "580.159.04", "cuda_driver_api": "13.0",
            "cuda_runtime": "13.0", "kvferry_version": "0.1.0", "git_commit": "synthetic", "host_threads": 16,
            "command": "synthetic", "label": "SYNTHETIC TEST DATA", "mode": "sweep", "options": {}, "timing": "synthetic"}
    results = []
    for p in ("llama-nhd", "llama-hnd"):
        hnd = p.endswith("hnd")
        for t in (256, 1024, 4096):
            results.append(transfer(p, "d2h", t, 52.0, small=52.5))
            # Planted miss: h2d of llama-hnd at 4 SMs reaches only 45 GB/s (83% of 54.5).
            results.append(transfer(p, "h2d", t, 53.5, small=45.0 if hnd and t == 4096 else 53.0))
            # Planted miss: d2d with 256-byte runs at 70% of the limit; and slower than cub there.
            results.append(transfer(p, "d2d", t, 1470.0 if hnd else 1950.0, avg_run=256.0 if hnd else 32768.0,
                                    cub=1600.0 if hnd else None))
    caps = transfer("llama-nhd", "d2h", 8192, 30.0)
    caps["kvferry"] = [dict(sms_cap=c, sms_cap_label=str(c), sms_used=c, route="d2h", tasks=10,
                            stats_payload_bytes=caps["payload_bytes"], **timing(g, caps["payload_bytes"]))
                       for c, g in ((1, 14.0), (2, 27.0), (4, 51.0), (8, 53.0))]
    caps["baselines"] = {"limit": timing(54.0, caps["payload_bytes"])}
    results.append(caps)
    results.append({"kind": "latency", "preset": "deepseek", "direction": "d2h", "op": "gather", "tokens": 256,
                    "tokens_requested": 256, "payload_bytes": 17989632, "runs": 244, "avg_run_bytes": 73728.0,
                    "verify": {"ran": True, "ok": True}, "sms_used": 8, "route": "d2h",
                    "kvferry": {"ok": True, "reps": 200, "gpu_us": 350.0, "gpu_p90_us": 360.0, "enqueue_us": 6.0,
                                "wall_us": 365.0, "wall_p90_us": 380.0},
                    "memcpy_same_bytes": {"ok": True, "reps": 200, "gpu_us": 335.0, "gpu_p90_us": 340.0,
                                          "enqueue_us": 3.0, "wall_us": 345.0, "wall_p90_us": 350.0},
                    "memcpy_per_run": {"ok": True, "reps": 50, "gpu_us": 900.0, "gpu_p90_us": 950.0,
                                       "enqueue_us": 500.0, "wall_us": 950.0, "wall_p90_us": 990.0}})
    rows = [{"direction": "d2h", "transfer": "memcpy", "payload_bytes": 1 << 29, "ok": True, "transfers_per_sample": 5,
             "transfer_alone_us": 9900.0, "transfer_gbps_alone": 54.0, "transfer_gbps_during": 53.0,
             "workload_us": 25100.0, "slowdown": 0.004, "covered": 1.0}]
    for cap, used, slow in ((0, 8, 0.05), (4, 4, 0.02), (132, 132, 0.2)):
        rows.append({"direction": "d2h", "transfer": "kvferry", "payload_bytes": 1 << 29, "sms_cap": cap,
                     "sms_cap_label": "default" if cap == 0 else str(cap), "sms_used": used, "ok": True,
                     "transfers_per_sample": 5, "transfer_alone_us": 9950.0, "transfer_gbps_alone": 53.8,
                     "transfer_gbps_during": 50.0, "workload_us": 25000.0 * (1 + slow), "slowdown": slow,
                     "covered": 1.0})
    results.append({"kind": "interference", "preset": "llama-nhd", "tokens": 4096,
                    "workload": {"desc": "synthetic GEMM", "cublas": True, "ops_per_sample": 18, "alone_us": 25000.0,
                                 "alone_after_us": 25050.0, "alone_spread": 0.004, "tflops_alone": 780.0},
                    "rows": rows})
    doc = {"schema": "kvferry-bench/1", "complete": True, "seconds": 1.0, "meta": meta, "results": results,
           "skipped": [{"preset": "llama-nhd", "direction": "p2p", "tokens": 0, "reason": "needs a second GPU (1 visible)"}],
           "errors": []}
    with open(os.path.join(directory, "synthetic.json"), "w") as f:
        json.dump(doc, f)


def issue15_doc():
    """Synthetic runs for issue 15's verdicts: one-chunk rows with peers,
    tuning variants, enqueue times, an MLA latency record, interference with
    peers, sustained figures. Planted: llama-hnd d2h one chunk at 92.6%
    (default cap), its enqueue at 14 us, lmcache-mp ahead of kvferry on
    llama-nhd d2h, the MLA D2D latency at 1.5x; batch ahead of kvferry on GPU
    time on llama-nhd d2h (55 vs 52 GB/s) but far behind sustained (its host
    enqueue: 20 vs 50 GB/s); cub behind on GPU time on llama-hnd d2h but ahead
    sustained (44 vs 40 GB/s)."""
    meta = {"gpu": "NVIDIA H200", "date": "2026-12-01", "sm_count": 132}
    results = []
    for p, kvf, enq in (("llama-nhd", 52.0, 6.0), ("llama-hnd", 50.0, 14.0)):
        for dr in ("d2h", "h2d"):
            r = transfer(p, dr, 256, kvf if dr == "d2h" else 53.0, small=50.0)
            r["chunk_tokens"] = 256
            for e in r["kvferry"]:
                e["enqueue_alone_us"] = enq if dr == "d2h" else 5.0
                e["path"] = {"name": "staged", "batches": 1, "pieces": 4, "launches": 4, "slice_bytes": 2048}
            r["peers"] = {"lmcache-mp": dict(shape="x", **timing(53.0 if p == "llama-nhd" else 40.0, r["payload_bytes"])),
                          "sglang-q2": {"ok": False, "error": "not applicable: rows not a multiple of 8 bytes"}}
            if p == "llama-nhd" and dr == "d2h":
                r["kvferry"].append(dict(sms_cap=0, sms_cap_label="default", tune="batch_max_runs=0,pieces=8",
                                         path={"name": "staged", "pieces": 8}, **timing(53.5, r["payload_bytes"])))
            if dr == "d2h":  # the deferred calls' post: 8 us (met), 12 us on llama-hnd (missed)
                r["kvferry"].append(dict(sms_cap=0, sms_cap_label="default", tune="defer=1",
                                         enqueue_alone_us=8.0 if p == "llama-nhd" else 12.0,
                                         path={"name": "staged", "deferred": 1}, **timing(kvf, r["payload_bytes"])))
            kvf_gb = r["kvferry"][0]["gbps"]
            cub_gb = r["baselines"]["cub"]["gbps"]
            if p == "llama-nhd" and dr == "d2h":
                r["baselines"]["batch"].update(timing(55.0, r["payload_bytes"]))
                add_sustained(r, kvf=50.0, batch=20.0, cub=cub_gb * 0.9)
            elif p == "llama-hnd" and dr == "d2h":
                add_sustained(r, kvf=40.0, batch=2.5, cub=44.0)
            else:
                add_sustained(r, kvf=kvf_gb * 0.97, batch=2.5, cub=cub_gb * 0.9)
            results.append(r)
        r = transfer(p, "d2d", 4096, 1950.0)
        r["chunk_tokens"] = 256
        if p == "llama-nhd":  # llama-hnd's d2d stays without them: a size where they are missing
            add_sustained(r, kvf=1900.0, batch=4.0, cub=1600.0)
        results.append(r)
    results.append({"kind": "latency", "preset": "deepseek-v3-mla-bf16", "direction": "d2d", "tokens": 256,
                    "kvferry": {"ok": True, "gpu_us": 25.0, "wall_us": 30.0, "enqueue_us": 5.0},
                    "memcpy_same_bytes": {"ok": True, "gpu_us": 15.0, "wall_us": 20.0}})
    results.append({"kind": "latency", "preset": "deepseek-v3-mla-bf16", "direction": "d2h", "tokens": 256,
                    "kvferry": {"ok": True, "gpu_us": 335.0, "wall_us": 345.0, "enqueue_us": 5.0},
                    "memcpy_same_bytes": {"ok": True, "gpu_us": 330.0, "wall_us": 340.0}})
    rows = [{"direction": "d2h", "transfer": "memcpy", "ok": True, "slowdown": 0.004},
            {"direction": "d2h", "transfer": "kvferry", "sms_cap": 0, "sms_cap_label": "default", "ok": True,
             "slowdown": 0.01},
            {"direction": "d2h", "transfer": "kvferry", "sms_cap": 4, "sms_cap_label": "4", "ok": True, "slowdown": 0.02},
            {"direction": "d2h", "transfer": "peer", "peer": "lmcache-legacy", "ok": True, "slowdown": 0.5}]
    results.append({"kind": "interference", "preset": "llama-nhd", "tokens": 256, "chunk_tokens": 256,
                    "workload": {"desc": "synthetic", "alone_spread": 0.01}, "rows": rows})
    return {"schema": "kvferry-bench/1", "complete": True, "meta": meta, "results": results, "skipped": [],
            "errors": []}


def main():
    failures = []

    def check(cond, what):
        if not cond:
            failures.append(what)

    with tempfile.TemporaryDirectory() as tmp:
        synthetic(tmp)
        rc = report.main([tmp])
        check(rc == 0, f"report.main returned {rc}")
        md = open(os.path.join(tmp, "results.md")).read()
        d = report.load(tmp)
        v = {x.name.split(" ")[0] + str(i): x for i, x in enumerate(report.evaluate(d))}
        verdicts = list(v.values())
        check(verdicts[0].met is False, "PCIe target should be missed (llama-hnd h2d at 4 SMs)")
        check(any("llama-hnd h2d" in line and "short by" in line for line in verdicts[0].lines),
              "PCIe miss should name the pair and the shortfall")
        check(verdicts[1].met is False, "interference target should be missed (default cap at +5%)")
        check(any("MISSED" in line and "default" in line for line in verdicts[1].lines), "interference miss line")
        check(verdicts[2].met is False, "d2d 90% target should be missed (llama-hnd at 70%)")
        check(verdicts[3].met is False, "small-run target should be missed (70% < 80%)")
        check(any("short by 10.0 points" in line for line in verdicts[3].lines), "small-run shortfall of 10 points")
        check(verdicts[4].met is False, "cub comparison should be missed (1470 < 1600)")
        check("P2P not measured: needs a second GPU" in md, "p2p skip reason in the summary")
        check("Not kvferry's defaults" not in md, "runs without library_env (the defaults, or older JSON) are not flagged")
        # This JSON has no sustained fields (as before kvf_bench measured them): noted, not judged.
        v15 = report.evaluate15(d)
        gpu_v, sus_v = v15[7], v15[8]
        check(report.GPU_TIME in gpu_v.name and gpu_v.met is not None, "GPU-time batch/cub verdict judged")
        check(report.SUSTAINED in sus_v.name and sus_v.met is None, "sustained verdict not measured without fields")
        check(any(x.startswith("skipped") and "no sustained_us" in x for x in sus_v.lines),
              "missing sustained fields are skipped with a note: " + repr(sus_v.lines))
        check("Sustained GB/s not shown: no sustained_us" in md and "kvferry ÷ batch (sustained)" not in md,
              "no sustained table without sustained fields, one note")
        for section in ("## Targets", "## Bandwidth", "## SM caps", "## Latency of one request", "## Interference"):
            check(section in md, f"markdown section {section}")
        check("†" in md, "extrapolated baselines are marked")
        check(report.results_name(d.meta) == "2026-11-29-h200", "results directory name")
        try:
            import matplotlib  # noqa: F401
            for png in ("bandwidth.png", "smcaps.png", "presets.png"):
                p = os.path.join(tmp, png)
                check(os.path.exists(p) and os.path.getsize(p) > 10000, f"{png} written")
        except ImportError:
            print("test_report: matplotlib not installed; plots not checked")
    # --install copies the run's JSON and the probes' JSON lines and logs beside it.
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory() as root:
        synthetic(tmp)
        for name, text in (("params.jsonl", '{"probe": "params"}\n'), ("hops.log", "d2h memcpy 159.49 us\n")):
            with open(os.path.join(tmp, name), "w") as f:
                f.write(text)
        rc = report.main([tmp, "--install", "--results-root", root])
        check(rc == 0, f"report.main --install returned {rc}")
        dest = os.path.join(root, "2026-11-29-h200")
        for name in ("params.jsonl", "hops.log", "results.md"):
            check(os.path.exists(os.path.join(dest, name)), f"--install puts {name} in the results directory")
        # Files of 8 KiB or more go in compressed, and render as the plain ones did.
        big = [n for n in os.listdir(tmp) if n.endswith(".json") and os.path.getsize(os.path.join(tmp, n)) >= 8192]
        check(big, "the synthetic run has JSON of 8 KiB or more")
        for name in big:
            check(os.path.exists(os.path.join(dest, name + ".gz")) and not os.path.exists(os.path.join(dest, name)),
                  f"--install compresses {name}")
        report.main([tmp])  # the plain files, rendered where they are
        strip = lambda md: [line for line in md.splitlines() if "generated" not in line.lower()]
        check(strip(open(os.path.join(dest, "results.md")).read()) == strip(open(os.path.join(tmp, "results.md")).read()),
              "the installed results render as the plain ones")
    # A passing run: no planted misses -> every judged target met.
    with tempfile.TemporaryDirectory() as tmp:
        doc = {"schema": "kvferry-bench/1", "complete": True, "meta": {"gpu": "NVIDIA H200", "date": "2026-11-29"},
               "results": [transfer("x", "d2h", 4096, 53.0, small=52.0), transfer("x", "d2d", 4096, 2000.0)],
               "skipped": [], "errors": []}
        with open(os.path.join(tmp, "ok.json"), "w") as f:
            json.dump(doc, f)
        vs = report.evaluate(report.load(tmp))
        check(vs[0].met is True and vs[2].met is True and vs[4].met is True, "clean data should meet the targets")
        check(vs[1].met is None, "no interference data: not measured")
    # Issue 15's verdicts, per-size tables, crossovers and the brief summary.
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "i15.json"), "w") as f:
            json.dump(issue15_doc(), f)
        rc = report.main([tmp])
        check(rc == 0, f"report.main (issue 15) returned {rc}")
        md = open(os.path.join(tmp, "results.md")).read()
        d = report.load(tmp)
        v15 = report.evaluate15(d)
        by = {v.name.split(":")[0] + str(i): v for i, v in enumerate(v15)}
        vs = list(by.values())
        check(vs[0].met is False, "one-chunk default-cap target should be missed (llama-hnd d2h 92.6%)")
        check(any("llama-hnd d2h" in x and "short by 2.4 points" in x for x in vs[0].lines),
              "one-chunk miss should name the row and the shortfall: " + repr(vs[0].lines))
        check(vs[1].met is True, "4-SM target: every one-chunk row at 50 GB/s (91.7-92.6%) meets 90%")
        check(vs[4].met is False and any("llama-hnd d2h" in x for x in vs[4].lines), "enqueue miss (14 us)")
        check("deferred calls" in vs[5].name and vs[5].met is False and "1 of 2 rows meet it." in vs[5].lines
              and "missed: llama-hnd d2h: 12.0 µs" in vs[5].lines,
              "deferred enqueue: llama-hnd d2h's post at 12 us is the one miss: " + repr(vs[5].lines))
        vs = vs[:5] + vs[6:]  # the rest as before
        check(vs[5].met is False and any("MISSED: d2d" in x for x in vs[5].lines), "MLA D2D latency 1.5x missed")
        check(any("met: d2h" in x for x in vs[5].lines), "MLA D2H latency met")
        check(vs[6].met is True, "interference: kvferry rows at 1% and 2% meet < 3%")
        check(any("lmcache-legacy" in x for x in vs[6].lines), "interference lists the peers' rows")
        gpu_v, sus_v = vs[7], vs[8]
        check(report.GPU_TIME in gpu_v.name and report.SUSTAINED in sus_v.name, "both batch/cub verdicts, labelled")
        check(gpu_v.met is False and "11 of 12 comparisons meet it." in gpu_v.lines,
              "GPU time: batch ahead on llama-nhd d2h is the one miss: " + repr(gpu_v.lines))
        check(any(x.startswith("missed: llama-nhd d2h 256: 0.95× cudaMemcpyBatchAsync") and "behind by 5.5%" in x
                  for x in gpu_v.lines), "GPU-time miss names the row and the shortfall: " + repr(gpu_v.lines))
        check(sus_v.met is False and "9 of 10 comparisons meet it." in sus_v.lines,
              "sustained: cub ahead on llama-hnd d2h is the one miss: " + repr(sus_v.lines))
        check(any(x.startswith("missed: llama-hnd d2h 256: 0.91× cub::DeviceMemcpy::Batched") for x in sus_v.lines),
              "sustained miss names the row: " + repr(sus_v.lines))
        check(not any("llama-nhd d2h" in x and "missed" in x for x in sus_v.lines),
              "batch's GPU-time win on llama-nhd d2h is a loss sustained")
        check(any(x.startswith("skipped 2 comparisons") for x in sus_v.lines),
              "llama-hnd d2d has no sustained fields: skipped with a note: " + repr(sus_v.lines))
        check(vs[9].met is False and any("behind: llama-nhd d2h 256: lmcache-mp" in x for x in vs[9].lines),
              "peer ahead of kvferry is reported: " + repr(vs[9].lines))
        check(any("not applicable" in x for x in vs[9].lines), "a peer outside its design is listed")
        # The per-size sustained tables: kvferry 50 vs batch 20 GB/s sustained, 52 vs 55 on GPU time.
        check("| kvferry sustained | batch sustained | cub sustained | kvferry ÷ batch (sustained) |" in md,
              "sustained table header")
        check("| llama-nhd | d2h | 50.0 | 20.0 | 41.3 | 2.50× | 1.21× | 0.95× |" in md,
              "sustained row of llama-nhd d2h (GPU-time ratio beside it)")
        check("Sustained: not measured at this size." not in md, "every size here has sustained figures")
        for section in ("## Issue 15 targets", "## One table per request size", "### 256 tokens", "### 4096 tokens",
                        "## Crossovers", "batch_max_runs=0,pieces=8"):
            check(section in md, f"markdown section {section}")
        check("lmcache-mp" in md and "n/a" in md, "peers in the per-size tables")
        b = report.brief(d, v15)
        check("llama-hnd" in b and "missed" in b and len(b) < 12000, "brief summary")
        check(report.GPU_TIME in b and report.SUSTAINED in b and "sus/batch x2.50" in b, "brief: both verdicts")
    # A run that set the library's parameters (run_issue15.sh's kernel fallback
    # sets KVF_XFER_KERNEL=1) says so above its verdicts, in results.md and in
    # the brief summary whose lines the harness's short table keeps.
    with tempfile.TemporaryDirectory() as tmp:
        doc = issue15_doc()
        doc["meta"]["library_env"] = {"KVF_XFER_KERNEL": "1"}
        with open(os.path.join(tmp, "fallback.json"), "w") as f:
            json.dump(doc, f)
        with open(os.path.join(tmp, "plain.json"), "w") as f:
            json.dump(dict(issue15_doc(), results=[]), f)
        report.main([tmp])
        md = open(os.path.join(tmp, "results.md")).read()
        check("## ⚠ Not kvferry's defaults" in md and "- KVF_XFER_KERNEL=1 (fallback.json)" in md,
              "a run on set parameters is flagged, naming the setting and its file")
        check(-1 < md.find("Not kvferry's defaults") < md.find("## Issue 15 targets"), "the flag comes before the verdicts")
        d = report.load(tmp)
        b = report.brief(d, report.evaluate15(d))
        check(any(line.startswith("    settings  not kvferry's defaults") and "KVF_XFER_KERNEL=1 (fallback.json)" in line
                  for line in b.splitlines()), "the brief summary flags it in a line the short table keeps: " + b[-600:])
    # Committed results keep their raw JSON gzip-compressed: the same files
    # compressed render the same tables.
    with tempfile.TemporaryDirectory() as tmp:
        synthetic(tmp)
        report.main([tmp])
        plain = open(os.path.join(tmp, "results.md")).read()
        for name in os.listdir(tmp):
            if name.endswith(".json"):
                path = os.path.join(tmp, name)
                with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as g:
                    g.write(f.read())
                os.remove(path)
        report.main([tmp])
        packed = open(os.path.join(tmp, "results.md")).read()
        strip = lambda md: [line for line in md.splitlines() if "generated" not in line.lower()]
        check(strip(packed) == strip(plain), "gzip-compressed JSON renders as the plain JSON does")
    host_path_checks(check)
    if failures:
        for f in failures:
            print("FAIL:", f)
        return 1
    print("test_report: ok")
    return 0


def host_path_run(rows):
    """A kvf_host_path JSON document (its writer's fields) of (preset, dir, host_us, plan_us, error)."""
    return {"schema": "kvf_host_path/1", "tokens": 256, "reps": 10, "verify_only": False,
            "rows": [{"preset": p, "direction": d, "path": "staged", "payload_bytes": 1, "verified": not err,
                      "host_us": h, "p10_us": h, "p90_us": h, "plan_us": pl, "launches": 2, "copies": 2,
                      "batch_runs": 0, "pointer_queries": 1, "page_faults": 0, "skipped": "", "error": err}
                     for p, d, h, pl, err in rows]}


def host_path_checks(check):
    """report_host_path.py: the lowest median of each label's rounds, ratios to the first label,
    failed rows left out, compressed rounds read, malformed arguments refused."""
    with tempfile.TemporaryDirectory() as tmp:
        files = {
            "a1.json": [("llama", "d2h", 10.0, 8.0, ""), ("mla", "d2h", 4.0, 3.0, "")],
            "a2.json": [("llama", "d2h", 9.0, 7.5, ""), ("mla", "d2h", 5.0, 3.5, ""), ("tp4", "h2d", 4.0, 3.0, "")],
            "b1.json": [("llama", "d2h", 6.0, 4.0, ""), ("mla", "d2h", 0.1, 0.1, "differs"),
                        ("tp4", "h2d", 3.0, 2.0, "")],
        }
        for name, rows in files.items():
            with open(os.path.join(tmp, name), "w") as f:
                json.dump(host_path_run(rows), f)
        # A label whose row took another route (the batch route) says so.
        with open(os.path.join(tmp, "b1.json")) as f:
            doc = json.load(f)
        doc["rows"][2]["path"] = "copy-batch"
        with open(os.path.join(tmp, "b1.json"), "w") as f:
            json.dump(doc, f)
        with gzip.open(os.path.join(tmp, "b2.json.gz"), "wt") as f:
            json.dump(host_path_run([("llama", "d2h", 7.0, 4.5, "")]), f)
        j = lambda n: os.path.join(tmp, n)  # noqa: E731
        out = os.path.join(tmp, "out")
        rc = report_host_path.main([out, f"base={j('a1.json')},{j('a2.json')}", f"new={j('b1.json')},{j('b2.json.gz')}"])
        check(rc == 0, f"report_host_path.main returned {rc}")
        md = open(os.path.join(out, "host-path.md")).read()
        check("| llama | d2h | staged | 9.00 | 7.50 | 6.00 | 4.00 | 0.667 |" in md,
              "host path: the lowest median per label and the ratio to the first")
        check("| mla | d2h | staged | 4.00 | 3.00 | - | - | - |" in md, "host path: a failed row is left out")
        check("Rounds per label: base: 2, new: 2." in md, "host path: rounds per label")
        check("| tp4 | h2d | staged / copy-batch | 4.00 | 3.00 | 3.00 | 2.00 | 0.750 |" in md,
              "host path: a row whose route differs between labels names both")
        check(report_host_path.main([out, "base"]) == 2, "host path: an argument without = is refused")
        try:
            import matplotlib  # noqa: F401
            check(os.path.getsize(os.path.join(out, "host-path.png")) > 0, "host path: the plot")
        except ImportError:
            pass


def test_report():
    assert main() == 0


if __name__ == "__main__":
    sys.exit(main())
