#!/usr/bin/env python3
"""The tables, chart and docs section of one scripts/bench.sh run, from its CSV.

Writes OUT_DIR/table.md and OUT_DIR/drive-bytes.svg (bytes reaching the drive as a share of
the bytes the guest wrote, one bar per server and write job), and with --doc replaces the
text between the "bench.sh results" markers of that file. Standard library only.
"""
import argparse
import csv
import html
import os
import sys

SERVERS = [
    ("qemu-nbd", "qemu-nbd raw"),
    ("nbdkit", "nbdkit file"),
    ("qcow2-64k", "qcow2 64k on ext4"),
    ("qcow2-128k", "qcow2 128k+l2 on ext4"),
    ("fewerbytes-before", "fewerbytes before (FB_BEFORE)"),
    ("fewerbytes", "fewerbytes"),
]
COLOURS = {
    "qemu-nbd": "#7f7f7f",
    "nbdkit": "#bcbd22",
    "qcow2-64k": "#1f77b4",
    "qcow2-128k": "#9467bd",
    "fewerbytes-before": "#ff9896",
    "fewerbytes": "#d62728",
}
SETS = [("plain", "the plain drive (a loop device over a sparse file in tmpfs)"),
        ("throttled", "the throttled drive (a hard disk's speed)")]
BEGIN = "<!-- bench.sh results: begin (scripts/bench.sh writes this section; edits are lost) -->"
END = "<!-- bench.sh results: end -->"


def load(path):
    rows = {}
    order = {}
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            rows[(r["set"], r["workload"], r["server"])] = r
            order.setdefault(r["set"], [])
            if r["workload"] not in order[r["set"]]:
                order[r["set"]].append(r["workload"])
    return rows, order


def drive_share(r):
    guest = int(r["guest_bytes"])
    return 100 * int(r["drive_bytes"]) / guest if guest else None


def is_read(workload):
    return "randread" in workload


def is_latency(workload):
    return workload.endswith("QD1")


def tables(rows, order, servers):
    out = []
    # fewerbytes-before is an earlier build of fewerbytes itself, never a peer.
    peers = [s for s, _ in servers if not s.startswith("fewerbytes")]
    for set_key, set_name in SETS:
        if set_key not in order:
            continue
        out.append(f"On {set_name}:\n")
        head = ["workload"] + [name for _, name in servers]
        if "fewerbytes" in dict(servers) and peers:
            head += ["fewerbytes vs best peer", "bytes reaching the drive: fewerbytes / best peer"]
        before = "fewerbytes" in dict(servers) and "fewerbytes-before" in dict(servers)
        if before:
            head += ["fewerbytes vs before"]
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "---|" * len(head))
        for w in order[set_key]:
            cells = [w + (" (mean latency, µs)" if is_latency(w) else " (MiB/s)")]
            for s, _ in servers:
                r = rows.get((set_key, w, s))
                cells.append("–" if r is None else (r["read_lat_us"] if is_latency(w) else r["mib_s"]))
            fb = rows.get((set_key, w, "fewerbytes"))
            peer_rows = [rows[(set_key, w, p)] for p in peers if (set_key, w, p) in rows]
            if fb is not None and peer_rows:
                if is_latency(w):
                    best = min(peer_rows, key=lambda r: float(r["read_lat_us"]))
                    ratio = float(fb["read_lat_us"]) / float(best["read_lat_us"])
                    cells.append(f"**{ratio:.2f}×** the latency of {best['server']}")
                else:
                    best = max(peer_rows, key=lambda r: float(r["mib_s"]))
                    ratio = float(fb["mib_s"]) / float(best["mib_s"])
                    cells.append(f"**{ratio:.2f}×** {best['server']}")
                if is_read(w):
                    cells.append("–")
                else:
                    cells.append(f"**{drive_share(fb):.1f}%** / {drive_share(best):.1f}%")
            elif fb is not None and peers:
                cells += ["–", "–"]
            if before:
                old_row = rows.get((set_key, w, "fewerbytes-before"))
                if fb is None or old_row is None:
                    cells.append("–")
                elif is_latency(w):
                    ratio = float(fb["read_lat_us"]) / float(old_row["read_lat_us"])
                    cells.append(f"{ratio:.2f}× the latency")
                else:
                    cells.append(f"{float(fb['mib_s']) / float(old_row['mib_s']):.2f}×")
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
        writes = [w for w in order[set_key] if not is_read(w)]
        if writes:
            out.append("Bytes reaching the drive, % of the bytes the guest wrote (final flush included):\n")
            head = ["workload"] + [name for _, name in servers]
            out.append("| " + " | ".join(head) + " |")
            out.append("|" + "---|" * len(head))
            for w in writes:
                cells = [w]
                for s, _ in servers:
                    r = rows.get((set_key, w, s))
                    cells.append("–" if r is None else f"{drive_share(r):.1f}%")
                out.append("| " + " | ".join(cells) + " |")
            out.append("")
            out.append("Server CPU seconds per GiB the guest wrote:\n")
            out.append("| " + " | ".join(head) + " |")
            out.append("|" + "---|" * len(head))
            for w in writes:
                cells = [w]
                for s, _ in servers:
                    r = rows.get((set_key, w, s))
                    cells.append("–" if r is None else
                                 f"{float(r['server_cpu_s']) / (int(r['guest_bytes']) / 2**30):.2f}")
                out.append("| " + " | ".join(cells) + " |")
            out.append("")
    return "\n".join(out)


def short(workload):
    """'128k write QD8, seed mix' -> '128k mix': chart labels."""
    size = workload.split()[0]
    data = workload.rsplit(",", 1)[-1].strip()
    return f"{size} {dict(seed_mix='mix', zero_blocks='zeros').get(data.replace(' ', '_'), data)}"


def svg(rows, order, servers):
    groups = [(s, w) for s, _ in SETS for w in order.get(s, []) if not is_read(w)]
    bar_w, gap, left, top, plot_h = 14, 18, 60, 40, 260
    group_w = bar_w * len(servers) + gap
    width = left + group_w * len(groups) + 80
    label_h = 90
    height = top + plot_h + label_h + 30 + 18 * ((len(servers) + 2) // 3)
    values = [drive_share(rows[(s, w, k)]) for s, w in groups for k, _ in servers if (s, w, k) in rows]
    top_pct = max([100.0] + [v for v in values if v is not None])
    top_pct = 25 * int(top_pct / 25 + 1)

    def y(pct):
        return top + plot_h - plot_h * pct / top_pct

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="11">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{left}" y="20" font-size="14">Bytes reaching the drive, % of the bytes the guest wrote '
           f'(scripts/bench.sh; HDD: the throttled drive)</text>']
    for pct in range(0, top_pct + 1, 25):
        out.append(f'<line x1="{left}" x2="{width - 20}" y1="{y(pct):.1f}" y2="{y(pct):.1f}" '
                   f'stroke="#ddd"/>')
        out.append(f'<text x="{left - 6}" y="{y(pct) + 4:.1f}" text-anchor="end">{pct}%</text>')
    for i, (set_key, w) in enumerate(groups):
        x0 = left + i * group_w + gap / 2
        for j, (k, name) in enumerate(servers):
            r = rows.get((set_key, w, k))
            if r is None:
                continue
            v = drive_share(r)
            x = x0 + j * bar_w
            out.append(f'<rect x="{x:.1f}" y="{y(v):.1f}" width="{bar_w - 2}" '
                       f'height="{max(y(0) - y(v), 0.5):.1f}" fill="{COLOURS[k]}">'
                       f'<title>{html.escape(name)}, {html.escape(w)} ({set_key}): {v:.1f}%</title></rect>')
            if k == "fewerbytes":
                out.append(f'<text x="{x + bar_w / 2:.1f}" y="{y(v) - 3:.1f}" text-anchor="middle" '
                           f'font-size="9">{v:.0f}</text>')
        cx = x0 + bar_w * len(servers) / 2
        label = html.escape(("HDD: " if set_key == "throttled" else "") + short(w))
        out.append(f'<text transform="translate({cx:.1f},{y(0) + 10:.1f}) rotate(40)" '
                   f'font-size="10">{label}</text>')
    ly = top + plot_h + label_h
    for j, (k, name) in enumerate(servers):
        lx = left + (j % 3) * 220
        row_y = ly + 18 * (j // 3)
        out.append(f'<rect x="{lx}" y="{row_y}" width="12" height="12" fill="{COLOURS[k]}"/>')
        out.append(f'<text x="{lx + 16}" y="{row_y + 10}">{html.escape(name)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--csv", required=True)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--doc", default="")
    p.add_argument("--command", default="scripts/bench.sh")
    p.add_argument("--commit", default="")
    p.add_argument("--when", default="")
    p.add_argument("--note", default="")
    p.add_argument("--drive-note", default="")
    p.add_argument("--pool-info", default="")
    a = p.parse_args()
    rows, order = load(a.csv)
    present = {k[2] for k in rows}
    servers = [(s, n) for s, n in SERVERS if s in present]
    table = tables(rows, order, servers)
    with open(os.path.join(a.out_dir, "table.md"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(a.out_dir, "drive-bytes.svg"), "w") as f:
        f.write(svg(rows, order, servers))
    if not a.doc:
        return
    section = [BEGIN, "",
               f"Commit `{a.commit}`, {a.when}:", "", "```sh", a.command, "```", "",
               f"({a.note}.)", ""]
    if a.drive_note:
        section += [f"The {a.drive_note}.", ""]
    if a.pool_info:
        section += [f"fewerbytes pool on the last drive: {a.pool_info.strip()}", ""]
    section += [table, "CSV: [bench/results.csv](bench/results.csv). Chart of the bytes reaching the drive:",
                "", "![bytes reaching the drive](bench/drive-bytes.svg)", "", END]
    text = open(a.doc).read()
    if BEGIN not in text or END not in text:
        sys.exit(f"{a.doc} has no bench.sh results markers")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(a.doc, "w") as f:
        f.write(head + "\n".join(section) + tail)


if __name__ == "__main__":
    main()
