#!/usr/bin/env python3
"""perf/report_host_path.py - compare kvf_host_path runs (perf/README.md):
kvferry's own host time per call, by build or setting.

    report_host_path.py OUTDIR LABEL=RUN.json[,RUN.json...] [LABEL=...]

Each LABEL names a build (or a setting) and its rounds, one JSON file each;
rounds of different labels should alternate on the machine, whose other work
only ever adds time. A row (preset, direction) takes, per label, the lowest of
its rounds' medians (host_us and plan_us); the first label is the baseline
the others are divided by. Writes OUTDIR/host-path.md, and host-path.png
where matplotlib is installed. Files ending in .gz are read compressed."""
import json
import os
import sys

from report import open_result


def load(path):
    with open_result(path) as f:
        return json.load(f)


def parse_args(argv):
    """[(label, [paths])] from LABEL=a.json,b.json arguments; ValueError when malformed."""
    runs = []
    for arg in argv:
        label, eq, paths = arg.partition("=")
        if not eq or not label or not paths:
            raise ValueError(f"'{arg}' is not LABEL=RUN.json[,RUN.json...]")
        runs.append((label, [p for p in paths.split(",") if p]))
    return runs


def best_of(rounds):
    """{(preset, direction): {host_us, plan_us, path, rounds}} over rounds of one label:
    the lowest median of each (rows that failed or were skipped are left out)."""
    rows = {}
    for doc in rounds:
        for r in doc["rows"]:
            if r.get("error") or r.get("skipped") or not r.get("verified"):
                continue
            key = (r["preset"], r["direction"])
            cur = rows.setdefault(key, {"host_us": r["host_us"], "plan_us": r["plan_us"], "path": r["path"],
                                        "rounds": 0})
            cur["host_us"] = min(cur["host_us"], r["host_us"])
            cur["plan_us"] = min(cur["plan_us"], r["plan_us"])
            cur["rounds"] += 1
    return rows


def table(labeled):
    """Markdown lines: one row per (preset, direction) the baseline has."""
    base_label, base = labeled[0]
    head = ["preset", "dir", "path"]
    for label, _ in labeled:
        head += [f"{label} host us", f"{label} plan us"]
    for label, _ in labeled[1:]:
        head.append(f"{label} / {base_label} host")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key in sorted(base):
        # A label that took another route says so: its time is that route's.
        paths = [base[key]["path"]]
        for _, rows in labeled[1:]:
            if key in rows and rows[key]["path"] not in paths:
                paths.append(rows[key]["path"])
        cells = [key[0], key[1], " / ".join(paths)]
        for _, rows in labeled:
            r = rows.get(key)
            cells += [f"{r['host_us']:.2f}", f"{r['plan_us']:.2f}"] if r else ["-", "-"]
        for _, rows in labeled[1:]:
            r = rows.get(key)
            cells.append(f"{r['host_us'] / base[key]['host_us']:.3f}" if r and base[key]["host_us"] > 0 else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def plot(labeled, path):
    """Bars of host_us per row and label; False where matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    base = labeled[0][1]
    keys = sorted(base)
    fig, ax = plt.subplots(figsize=(max(8, len(keys) * 0.35), 4.5))
    width = 0.8 / len(labeled)
    for i, (label, rows) in enumerate(labeled):
        xs = [k + i * width for k in range(len(keys))]
        ax.bar(xs, [rows[k]["host_us"] if k in rows else float("nan") for k in keys], width, label=label)
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(keys))])
    ax.set_xticklabels([f"{p} {d}" for p, d in keys], rotation=80, fontsize=7)
    ax.set_ylabel("host us per call (best median)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv):
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    outdir = argv[0]
    try:
        runs = parse_args(argv[1:])
    except ValueError as e:
        print(f"report_host_path: {e}", file=sys.stderr)
        return 2
    labeled = [(label, best_of([load(p) for p in paths])) for label, paths in runs]
    if not labeled[0][1]:
        print(f"report_host_path: {labeled[0][0]} has no verified rows", file=sys.stderr)
        return 1
    os.makedirs(outdir, exist_ok=True)
    rounds = ", ".join(f"{label}: {len(paths)}" for label, paths in runs)
    lines = ["# kvferry's host time per call (kvf_host_path)", "",
             f"Rounds per label: {rounds}. Each cell: the lowest of the rounds' medians.", ""]
    lines += table(labeled)
    with open(os.path.join(outdir, "host-path.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    plot(labeled, os.path.join(outdir, "host-path.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
