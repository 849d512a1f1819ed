"""Draw an arena dump as a picture: regions to scale, fields coloured, failing checks in red.

Top panel: the whole arena to scale (regions above, metadata fields below, the guard band past
the capacity). Middle panel: the metadata blocks and the ``h_state_ptrs`` slot enlarged, with the
per-stream segments of the stacked fields marked. Bottom: the checks, PASS in green, FAIL in red;
the offending offsets of failing checks are red lines in both panels.

matplotlib is imported only when a picture is drawn, with the Agg canvas (no display, no pyplot). Bars are
drawn as one collection per row and colour, segment ticks as one collection per field (at most
:data:`MAX_TICKS` of them, evenly spaced, beyond what the picture's pixels can show), so drawing takes
seconds whatever the number of regions, streams and metadata blocks.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .dump import DEFAULT_MAX_BYTES, ArenaDump, load_dump

__all__ = ["render_dump", "MAX_TICKS"]

#: The most per-stream segment ticks drawn per field (the enlarged panel is about 1,500 pixels wide).
MAX_TICKS = 2000
#: The most labelled bars per panel row (only bars wider than 6% of the panel get a label anyway).
_MAX_LABELS = 32

_KIND_COLOURS = {"moe": "#8da0cb", "stream_block": "#b3b3b3", "stacked": "#66c2a5", "jit_slot": "#ffd92f",
                 "reserved": "#a6d854"}
_STATUS_COLOURS = {"PASS": "#1a9850", "FAIL": "#d73027", "SKIP": "#7f7f7f"}
_RED = "#d73027"


def _field_colours(names):
    from matplotlib import colormaps

    cmap = colormaps["tab10"]
    palette = [cmap(i) for i in (0, 1, 2, 4, 5, 6, 8, 9)]  # no red: red means "failing"
    return {name: palette[i % len(palette)] for i, name in enumerate(dict.fromkeys(names))}


def _bar(ax, x0, x1, y, h, colour, label=None, edge="black", lw=0.5, fontsize=7):
    from matplotlib.patches import Rectangle

    ax.add_patch(Rectangle((x0, y), max(x1 - x0, 0), h, facecolor=colour, edgecolor=edge, linewidth=lw))
    if label:
        xlim = ax.get_xlim()
        if (x1 - x0) > 0.06 * (xlim[1] - xlim[0]):
            ax.text((x0 + x1) / 2, y + h / 2, label, ha="center", va="center", fontsize=fontsize, clip_on=True)


def _bars(ax, spans, y, h, colours, edges=None, labels=None, lw=0.5, fontsize=7):
    """Many bars in one row as one collection per (colour, edge): ``spans`` of ``(x0, x1)``, a colour (and
    optionally an edge colour and a label) per bar. Labels only on bars wider than 6% of the panel."""
    groups: dict = {}
    for k, (x0, x1) in enumerate(spans):
        key = (colours[k], "black" if edges is None else edges[k])
        groups.setdefault(key, []).append((x0, max(x1 - x0, 0)))
    for (colour, edge), ranges in groups.items():
        ax.broken_barh(ranges, (y, h), facecolors=colour, edgecolors=edge,
                       linewidth=1.5 if edge == _RED else lw)
    if labels:
        xlim = ax.get_xlim()
        wide = [k for k, (x0, x1) in enumerate(spans) if labels[k] and (x1 - x0) > 0.06 * (xlim[1] - xlim[0])]
        for k in wide[:_MAX_LABELS]:
            x0, x1 = spans[k]
            ax.text((x0 + x1) / 2, y + h / 2, labels[k], ha="center", va="center", fontsize=fontsize, clip_on=True)


def render_dump(source, out, *, report=None, num_blocks: int | None = None, dpi: int = 110,
                max_bytes: int = DEFAULT_MAX_BYTES) -> Path:
    """Render a dump to a PNG.

    Parameters
    ----------
    source : str, os.PathLike or ArenaDump
    out : str or os.PathLike
        The PNG to write.
    report : InspectReport, optional
        Check results to highlight (default: run :func:`~q12drv.tools.inspect.inspect_dump`).
    num_blocks : int, optional
        Passed to the checks when ``report`` is not given.
    dpi : int
    max_bytes : int
        What loading a path may unpack at most (:func:`~q12drv.tools.dump.load_dump`).

    Returns
    -------
    pathlib.Path
        ``out``.

    Raises
    ------
    DumpError
        The dump cannot be read.
    ModuleNotFoundError
        matplotlib is not installed (``pip install 'q12drv[test]'`` or ``pip install matplotlib``).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from .inspect import inspect_dump

    d = source if isinstance(source, ArenaDump) else load_dump(source, max_bytes=max_bytes)
    report = report if report is not None else inspect_dump(d, num_blocks=num_blocks)
    fig = Figure(figsize=(14, 7.5), dpi=dpi)
    FigureCanvasAgg(fig)
    gs = fig.add_gridspec(3, 1, height_ratios=[2.2, 2.6, 1.6], hspace=0.55, left=0.07, right=0.84)
    ax_all, ax_meta, ax_checks = (fig.add_subplot(gs[i]) for i in range(3))
    colours = _field_colours([f.name for m in d.metas for f in m.fields])
    bad_offsets = [(r.name, f.offset) for r in report.checks if r.status == "FAIL"
                   for f in r.findings if f.offset is not None]
    failing = set(report.failed)

    # whole arena, to scale
    total = d.capacity + d.guard.size
    ax_all.set_xlim(0, total)
    ax_all.set_ylim(0, 2.2)
    regions = d.region_map()
    _bars(ax_all, [(r.offset, r.end) for r in regions], 1.15, 0.9,
          [_KIND_COLOURS.get(r.kind, "#e5c494") for r in regions], labels=[r.name for r in regions])
    fields = [f for m in d.metas for f in m.fields]
    _bars(ax_all, [(f.offset, f.end) for f in fields], 0.15, 0.9, [colours[f.name] for f in fields], lw=0.2)
    guard_bad = "guard" in failing
    _bar(ax_all, d.capacity, total, 0.15, 1.9, _RED if guard_bad else "#d9d9d9", "guard", edge=_RED if guard_bad else "black")
    ax_all.set_yticks([0.6, 1.6], ["fields", "regions"])
    ax_all.set_title(f"{Path(d.path).name}: arena of {d.capacity:,} bytes at {d.base:#x} ({d.mode or 'no metadata'}, "
                     f"{'all checks pass' if report.ok else 'FAILED: ' + ', '.join(report.failed)})",
                     fontsize=10, color="black" if report.ok else _RED)
    ax_all.set_xlabel("arena offset (bytes)", fontsize=8)

    # metadata blocks enlarged
    spans = [(m.scratch_offset_bytes, m.end) for m in d.metas]
    if d.h_state is not None:
        spans.append((d.h_state.offset, d.h_state.end))
    lo, hi = (min(s[0] for s in spans), max(s[1] for s in spans)) if spans else (0, d.capacity)
    margin = max(8, (hi - lo) // 40)
    ax_meta.set_xlim(lo - margin, hi + margin)
    ax_meta.set_ylim(0, 2.2)
    bad_sorted = np.sort(np.array([off for _, off in bad_offsets], np.int64))

    def has_bad(lo: int, hi: int) -> bool:
        k = np.searchsorted(bad_sorted, lo)
        return bool(k < bad_sorted.size and bad_sorted[k] < hi)

    _bars(ax_meta, [(f.offset, f.end) for f in fields], 0.15, 0.9, [colours[f.name] for f in fields],
          edges=[_RED if has_bad(f.offset, f.end) else "black" for f in fields],
          labels=[f.name.replace("_stacked", "") for f in fields])
    ticks = []
    for m in d.metas:
        cu = m.cu_seqlens_host
        for f in m.fields:  # per-stream segments of a stacked field, or one entry per stream
            ticks.append(f.element_offset(cu[1:-1] if f.count == m.total_tokens else np.arange(1, f.count)))
    ticks = np.concatenate(ticks) if ticks else np.zeros(0, np.int64)
    if ticks.size > MAX_TICKS:  # more than the panel's pixels can tell apart: evenly spaced ones
        ticks = ticks[np.linspace(0, ticks.size - 1, MAX_TICKS).astype(np.int64)]
    if ticks.size:
        ax_meta.vlines(ticks, 0.15, 1.05, colors="white", linewidth=0.6)
    _bars(ax_meta, [(m.scratch_offset_bytes, m.end) for m in d.metas], 1.2, 0.35, ["#66c2a5"] * len(d.metas),
          labels=[m.name for m in d.metas])
    if d.h_state is not None:
        h_bad = "h_state_slot" in failing
        _bar(ax_meta, d.h_state.offset, d.h_state.end, 1.65 if h_bad else 1.2, 0.35, _RED if h_bad else "#ffd92f",
             "h_state_ptrs", edge=_RED if h_bad else "black")
    ax_meta.set_yticks([0.6, 1.4], ["fields", "blocks"])
    if colours:
        from matplotlib.patches import Patch

        ax_meta.legend(handles=[Patch(facecolor=c, edgecolor="black", label=n) for n, c in colours.items()],
                       loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=7, frameon=False)
    ax_meta.set_xlabel("arena offset (bytes), metadata enlarged; white ticks: per-stream segments", fontsize=8)

    for ax, (x0, x1) in ((ax_all, (0, total)), (ax_meta, ax_meta.get_xlim())):
        for name, off in bad_offsets:
            if x0 <= off <= x1:
                ax.axvline(off, color=_RED, linewidth=1.4)
        ax.tick_params(labelsize=7)

    # the checks
    ax_checks.axis("off")
    cols = 4
    for i, r in enumerate(report.checks):
        x, y = (i % cols) / cols, 1 - (i // cols) * 0.3
        ax_checks.text(x, y, f"{r.status} {r.name}", color=_STATUS_COLOURS[r.status], fontsize=9,
                       fontweight="bold" if r.status == "FAIL" else "normal", transform=ax_checks.transAxes,
                       va="top")
        if r.status == "FAIL" and r.findings:
            msg = r.findings[0].message
            ax_checks.text(x, y - 0.12, msg if len(msg) < 60 else msg[:57] + "...", color=_RED, fontsize=6,
                           transform=ax_checks.transAxes, va="top")
    out = Path(out)
    fig.savefig(out, format="png")
    return out
