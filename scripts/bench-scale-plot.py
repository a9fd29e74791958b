#!/usr/bin/env python3
"""Plot scripts/bench-scale.sh's table as an SVG: memory (RSS idle and after the
write) and times (ready, clean and kill -9 restarts until the index is back) against
the device's size, on a log scale.

    scripts/bench-scale.sh | tee scale.md
    scripts/bench-scale-plot.py < scale.md > docs/scale.svg
"""

import math
import re
import sys

UNITS = {"T": 1, "P": 1024}


def tib(size):
    m = re.fullmatch(r"(\d+)([TP])", size.strip())
    if not m:
        raise SystemExit(f"bench-scale-plot: not a device size: {size!r}")
    return int(m.group(1)) * UNITS[m.group(2)]


def first_number(cell):
    m = re.search(r"\d+(\.\d+)?", cell)
    if not m:
        raise SystemExit(f"bench-scale-plot: no number in {cell!r}")
    return float(m.group(0))


def last_number(cell):
    found = re.findall(r"\d+(?:\.\d+)?", cell)
    if not found:
        raise SystemExit(f"bench-scale-plot: no number in {cell!r}")
    return float(found[-1])


def rows(lines):
    header = None
    for line in lines:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or set(line.strip()) <= set("|-"):
            continue
        if header is None:
            header = cells
            continue
        yield dict(zip(header, cells))


def main():
    table = list(rows(sys.stdin))
    if not table:
        raise SystemExit("bench-scale-plot: no table rows on stdin")
    points = []
    for r in table:
        points.append(
            {
                "tib": tib(r["device"]),
                "idle": first_number(r["RSS idle MiB"]),
                "after": first_number(r["RSS after MiB"]),
                "ready": first_number(r["ready s"]),
                "clean": last_number(r["clean restart: serving / index ready s"]),
                "crash": last_number(r["kill -9 restart: serving / index ready s"]),
            }
        )
    panels = [
        ("memory (MiB)", [("idle", "RSS idle", "#1f77b4"), ("after", "RSS after the write", "#d62728")]),
        (
            "seconds",
            [
                ("ready", "serving after create", "#2ca02c"),
                ("clean", "clean restart: index back", "#9467bd"),
                ("crash", "kill -9 restart: index back", "#ff7f0e"),
            ],
        ),
    ]
    width, height, pad = 460, 300, 55
    xs = [math.log2(p["tib"]) for p in points]
    x0, x1 = min(xs), max(xs)
    svg = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * width}" height="{height}" '
        'font-family="sans-serif" font-size="11">'
    ]
    for n, (unit, series) in enumerate(panels):
        left = n * width
        top_value = max(p[key] for p in points for key, _, _ in series) * 1.1 or 1
        def px(x):
            return left + pad + (x - x0) / ((x1 - x0) or 1) * (width - 2 * pad)
        def py(v):
            return height - pad + 10 - v / top_value * (height - 2 * pad)
        svg.append(
            f'<line x1="{left + pad}" y1="{py(0)}" x2="{left + width - pad}" y2="{py(0)}" stroke="black"/>'
        )
        svg.append(
            f'<line x1="{left + pad}" y1="{py(0)}" x2="{left + pad}" y2="{py(top_value)}" stroke="black"/>'
        )
        svg.append(f'<text x="{left + 5}" y="{py(top_value) - 8}">{unit}</text>')
        for k in range(5):
            v = top_value * k / 4
            svg.append(f'<text x="{left + 8}" y="{py(v) + 4}">{v:.0f}</text>' if v >= 10 else
                       f'<text x="{left + 8}" y="{py(v) + 4}">{v:.1f}</text>')
        for p, x in zip(points, xs):
            label = f'{p["tib"]}T' if p["tib"] < 1024 else f'{p["tib"] // 1024}P'
            svg.append(f'<text x="{px(x) - 10}" y="{py(0) + 16}">{label}</text>')
        svg.append(
            f'<text x="{left + width / 2 - 40}" y="{height - 8}">device size (log scale)</text>'
        )
        for i, (key, name, colour) in enumerate(series):
            path = " ".join(f"{px(x):.1f},{py(p[key]):.1f}" for p, x in zip(points, xs))
            svg.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"/>')
            for p, x in zip(points, xs):
                svg.append(f'<circle cx="{px(x):.1f}" cy="{py(p[key]):.1f}" r="3" fill="{colour}"/>')
            svg.append(
                f'<text x="{left + pad + 10}" y="{pad - 25 + 14 * i}" fill="{colour}">{name}</text>'
            )
    svg.append("</svg>")
    print("\n".join(svg))


if __name__ == "__main__":
    main()
