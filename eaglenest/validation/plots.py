"""Plots drawn as plain SVG (no plotting dependency), inline in the report page: ``line_chart`` for
training curves, ``bar_chart`` for grouped bars (per-position acceptance, throughput, the matrix)."""

from __future__ import annotations

import html
import math


# ----------------------------------------------------------------------------- plots

# Colour-blind-safe (Okabe-Ito) palette.
COLOURS = ["#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000"]
FONT = "font-family:system-ui,-apple-system,'Segoe UI',sans-serif"


def esc(text) -> str:
    return html.escape(str(text), quote=True)


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About ``n`` round tick values covering [lo, hi] (1, 2, 5 times a power of ten apart)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return [0.0, 1.0]
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / max(n, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    start = math.floor(lo / step) * step
    ticks, t = [], start
    while t <= hi + step * 1e-9:
        ticks.append(round(t, 12))
        t += step
    if ticks[-1] < hi:
        ticks.append(round(t, 12))
    return ticks


def log_ticks(lo: float, hi: float) -> list[float]:
    """Ticks (as log10 values) at 1, 2 and 5 times the powers of ten inside [10**lo, 10**hi],
    thinned to 1 times the powers of ten when there are many."""
    ticks = [math.log10(m * 10**e) for e in range(math.floor(lo), math.ceil(hi) + 1) for m in (1, 2, 5)]
    ticks = [t for t in ticks if lo - 1e-9 <= t <= hi + 1e-9]
    if len(ticks) > 8:
        ticks = [t for t in ticks if abs(t - round(t)) < 1e-9]
    return ticks if len(ticks) >= 2 else [math.log10(v) for v in nice_ticks(10**lo, 10**hi) if v > 0]


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    if abs(v) >= 1 and float(v).is_integer():
        return f"{v:.0f}"
    return f"{v:.3g}"


def _frame(width, height, title, xlabel, ylabel, body, legend):
    parts = [
        f'<svg class="plot" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
        f'role="img" aria-label="{esc(title)}" style="{FONT};font-size:12px">',
        f'<text x="{width / 2:.1f}" y="18" text-anchor="middle" font-size="14" font-weight="600">{esc(title)}</text>',
        body,
        f'<text x="{width / 2:.1f}" y="{height - 6}" text-anchor="middle">{esc(xlabel)}</text>',
        f'<text transform="translate(14,{height / 2:.1f}) rotate(-90)" text-anchor="middle">{esc(ylabel)}</text>',
        legend,
        "</svg>",
    ]
    return "\n".join(parts)


def _legend(labels, x, y):
    out = []
    for i, label in enumerate(labels):
        yy = y + 16 * i
        out.append(f'<rect x="{x}" y="{yy - 9}" width="12" height="10" fill="{COLOURS[i % len(COLOURS)]}"/>'
                   f'<text x="{x + 16}" y="{yy}">{esc(label)}</text>')
    return "\n".join(out)


def line_chart(series, *, title, xlabel, ylabel, width=560, height=320, ylim=None, logy=False) -> str:
    """``series``: list of ``(label, xs, ys)``; non-finite points are skipped. Returns an <svg>."""
    left, right, top, bottom = 62, 150, 30, 42
    pw, ph = width - left - right, height - top - bottom
    tr = (lambda v: math.log10(v)) if logy else (lambda v: v)
    pts = [(x, y) for _, xs, ys in series for x, y in zip(xs, ys)
           if math.isfinite(x) and math.isfinite(y) and (y > 0 or not logy)]
    if not pts:
        return _frame(width, height, title, xlabel, ylabel,
                      f'<text x="{width / 2}" y="{height / 2}" text-anchor="middle">no data</text>', "")
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    if ylim:
        y0, y1 = ylim
    else:
        y0, y1 = min(tr(p[1]) for p in pts), max(tr(p[1]) for p in pts)
    xt = nice_ticks(x0, x1)
    if logy:
        yt = log_ticks(y0, y1)
        y0, y1 = min(y0, yt[0]), max(y1, yt[-1])
    else:
        yt = nice_ticks(y0, y1)
        if not ylim:
            y0, y1 = yt[0], yt[-1]
    x0, x1 = xt[0], xt[-1]
    sx = lambda v: left + (v - x0) / ((x1 - x0) or 1) * pw  # noqa: E731
    sy = lambda v: top + ph - (v - y0) / ((y1 - y0) or 1) * ph  # noqa: E731
    body = [f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>']
    for t in xt:
        body.append(f'<line x1="{sx(t):.1f}" x2="{sx(t):.1f}" y1="{top + ph}" y2="{top + ph + 4}" stroke="#999"/>'
                    f'<text x="{sx(t):.1f}" y="{top + ph + 16}" text-anchor="middle">{_fmt(t)}</text>')
    for t in yt:
        if y0 - 1e-12 <= t <= y1 + 1e-12:
            label = _fmt(10**t) if logy else _fmt(t)
            body.append(f'<line x1="{left}" x2="{left + pw}" y1="{sy(t):.1f}" y2="{sy(t):.1f}" stroke="#eee"/>'
                        f'<text x="{left - 6}" y="{sy(t) + 4:.1f}" text-anchor="end">{label}</text>')
    for i, (_, xs, ys) in enumerate(series):
        coords = [f"{sx(x):.1f},{sy(tr(y)):.1f}" for x, y in zip(xs, ys)
                  if math.isfinite(x) and math.isfinite(y) and (y > 0 or not logy)]
        if len(coords) == 1:
            cx, cy = coords[0].split(",")
            body.append(f'<circle cx="{cx}" cy="{cy}" r="3" fill="{COLOURS[i % len(COLOURS)]}"/>')
        elif coords:
            body.append(f'<polyline fill="none" stroke="{COLOURS[i % len(COLOURS)]}" stroke-width="1.6" '
                        f'points="{" ".join(coords)}"/>')
    legend = _legend([s[0] for s in series], left + pw + 12, top + 12)
    return _frame(width, height, title, xlabel, ylabel, "\n".join(body), legend)


def bar_chart(categories, series, *, title, xlabel, ylabel, width=560, height=320, ylim=None, fmt="{:.2f}") -> str:
    """Grouped bars: ``categories`` along x, ``series`` a list of ``(label, values)`` (None: no bar)."""
    left, right, top, bottom = 62, 150, 30, 42
    pw, ph = width - left - right, height - top - bottom
    values = [v for _, vs in series for v in vs if v is not None and math.isfinite(v)]
    y1 = ylim[1] if ylim else (nice_ticks(0, max(values))[-1] if values and max(values) > 0 else 1.0)
    yt = [t for t in nice_ticks(0, y1) if t <= y1 + 1e-12]
    sy = lambda v: top + ph - v / (y1 or 1) * ph  # noqa: E731
    body = [f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>']
    for t in yt:
        body.append(f'<line x1="{left}" x2="{left + pw}" y1="{sy(t):.1f}" y2="{sy(t):.1f}" stroke="#eee"/>'
                    f'<text x="{left - 6}" y="{sy(t) + 4:.1f}" text-anchor="end">{_fmt(t)}</text>')
    n_cat, n_ser = max(len(categories), 1), max(len(series), 1)
    group = pw / n_cat
    bar = group * 0.8 / n_ser
    for c, cat in enumerate(categories):
        gx = left + c * group + group * 0.1
        body.append(f'<text x="{left + (c + 0.5) * group:.1f}" y="{top + ph + 16}" text-anchor="middle">{esc(cat)}</text>')
        for s, (_, vs) in enumerate(series):
            v = vs[c] if c < len(vs) else None
            if v is None or not math.isfinite(v):
                continue
            h = max(0.0, min(v, y1)) / (y1 or 1) * ph
            x = gx + s * bar
            body.append(f'<rect x="{x:.1f}" y="{top + ph - h:.1f}" width="{bar * 0.92:.1f}" height="{h:.1f}" '
                        f'fill="{COLOURS[s % len(COLOURS)]}"><title>{esc(fmt.format(v))}</title></rect>')
            body.append(f'<text x="{x + bar * 0.46:.1f}" y="{top + ph - h - 3:.1f}" text-anchor="middle" '
                        f'font-size="10">{esc(fmt.format(v))}</text>')
    legend = _legend([s[0] for s in series], left + pw + 12, top + 12)
    return _frame(width, height, title, xlabel, ylabel, "\n".join(body), legend)
