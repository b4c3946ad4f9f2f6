"""The forward report: result records, console tables, Markdown, CSV and charts.

Everything here works on plain records (dicts), so it runs and is tested without a GPU,
and ``--replot`` can redraw a saved run.
"""

import dataclasses

from .common import fmt_num, fmt_us, format_header, geomean, render_table
from .peers import COPY, DESCRIPTIONS, IMPLS, IN_PLACE, IN_PLACE_PEERS, OP_TITLES, OPS, OURS, PEERS
from .timing import MODE_TITLES, MODES

FIELDS = ("op", "dtype", "tokens", "hidden", "impl", "mode", "us", "GBps", "pct_copy", "bytes",
          "calls", "repeats", "max_abs_err")
PLAN_TEXT_KEYS = (("variant", ""), ("threads_per_row", "g"), ("vecs_per_thread", "nv"),
                  ("vec", "v"), ("cluster", "c"), ("block", "b"), ("grid", "grid"))
LARGE_ELEMENTS = 4096 * 4096     # "large shapes": tokens x hidden at least this (far past the L2)


def make_record(op, dtype, tokens, hidden, impl, mode, us, nbytes, copy_gbps, calls, repeats,
                max_abs_err=None, plan=None):
    """One measurement: ``us`` microseconds per call moving ``nbytes`` logical bytes."""
    gbps = nbytes / (us * 1e3) if us > 0 else float("inf")
    if dataclasses.is_dataclass(plan):
        plan = dataclasses.asdict(plan)
    return {"op": op, "dtype": dtype, "tokens": tokens, "hidden": hidden, "impl": impl, "mode": mode,
            "us": us, "GBps": gbps, "pct_copy": 100.0 * gbps / copy_gbps if copy_gbps else None,
            "bytes": nbytes, "calls": calls, "repeats": repeats, "max_abs_err": max_abs_err,
            "plan": plan}


# -- numbers as text ------------------------------------------------------------------------------
def plan_text(plan):
    """A launch plan in a few characters: ``registers g256 nv2 v8 c1 b256 grid4096``
    (``+edges`` when rows may have a scalar head or tail)."""
    if not plan:
        return "-"
    parts = [f"{prefix}{plan[key]}" for key, prefix in PLAN_TEXT_KEYS if key in plan]
    if plan.get("edges"):
        parts.append("+edges")
    known = {key for key, _ in PLAN_TEXT_KEYS} | {"rows_per_block", "edges"}
    parts += [f"{k}={v}" for k, v in plan.items() if k not in known]
    return " ".join(parts)


# -- grouping -------------------------------------------------------------------------------------
def _order(values, preferred):
    seen = list(dict.fromkeys(values))
    return [v for v in preferred if v in seen] + [v for v in seen if v not in preferred]


def group(records):
    """{(mode, op, dtype): {(tokens, hidden): {impl: record}}}, modes and ops in the
    usual order, dtypes and shapes as measured."""
    modes = _order([r["mode"] for r in records], MODES)
    ops = _order([r["op"] for r in records], OPS)
    dtypes = _order([r["dtype"] for r in records], ())
    out = {}
    for mode in modes:
        for op in ops:
            for dtype in dtypes:
                by_shape = {}
                for r in records:
                    if (r["mode"], r["op"], r["dtype"]) == (mode, op, dtype):
                        by_shape.setdefault((r["tokens"], r["hidden"]), {})[r["impl"]] = r
                if by_shape:
                    out[(mode, op, dtype)] = by_shape
    return out


def best_peer(by_impl, among=PEERS):
    """(name, record) of the fastest of ``among`` (the out-of-place peers; never ours, the
    in-place forms or the copy) in ``by_impl``, or None."""
    peers = [(r["us"], name) for name, r in by_impl.items() if name not in OURS and name in among]
    if not peers:
        return None
    us, name = min(peers)
    return name, by_impl[name]


def time_ratio(by_impl, a, b):
    """``a``'s time over ``b``'s in ``by_impl``, or None where either is missing."""
    if a in by_impl and b in by_impl:
        return by_impl[a]["us"] / by_impl[b]["us"]
    return None


def impls_present(by_shape):
    names = {name for d in by_shape.values() for name in d}
    return _order(sorted(names), IMPLS)


# -- console -----------------------------------------------------------------------------------------
def format_tables(records, markdown=False):
    """Per mode, op and dtype: our time, GB/s, % of copy bandwidth, our time over each
    other implementation's, the ratio to the best peer, where measured our time over the
    copy of the same bytes and the in-place form's time and ratios, and our launch plan."""
    blocks = []
    for (mode, op, dtype), by_shape in group(records).items():
        present = impls_present(by_shape)
        others = [n for n in present if n != "ours" and (n in OURS or n in PEERS)]
        extra = []   # (header, cell of a shape's {impl: record}): the copy and the in-place form
        if COPY in present:
            extra.append(("ours/copy", lambda d: fmt_num(time_ratio(d, "ours", COPY))))
        if "ours_ip" in present:
            extra.append(("ip us", lambda d: fmt_us(d["ours_ip"]["us"]) if "ours_ip" in d else "-"))
            extra += [(f"ip / {n}", lambda d, n=n: fmt_num(time_ratio(d, "ours_ip", n)))
                      for n in present if n in IN_PLACE_PEERS]
        headers = (["shape", "ours us", "GB/s", "%copy"] + others + ["vs best peer"]
                   + [h for h, _ in extra] + ["plan"])
        rows, to_best, wins, to_copy = [], [], 0, []
        for (tokens, hidden), d in by_shape.items():
            ours = d.get("ours")
            row = [f"{tokens}x{hidden}"]
            row += [fmt_us(ours["us"]), fmt_num(ours["GBps"], 0), fmt_num(ours["pct_copy"], 1)] if ours else ["-"] * 3
            row += [fmt_num(time_ratio(d, "ours", n)) for n in others]
            best = best_peer(d)
            if ours and best:
                ratio = ours["us"] / best[1]["us"]
                to_best.append(ratio)
                wins += ratio <= 1.0
                row.append(f"{ratio:.2f} {best[0]}")
            else:
                row.append("-")
            row += [cell(d) for _, cell in extra]
            copy_ratio = time_ratio(d, "ours", COPY)
            if copy_ratio is not None and tokens * hidden >= LARGE_ELEMENTS:
                to_copy.append((copy_ratio, f"{tokens}x{hidden}"))
            row.append(plan_text(next((r.get("plan") for r in d.values() if r.get("plan")), None)))
            rows.append(row)
        title = f"{OP_TITLES.get(op, op)}, {dtype}, {MODE_TITLES.get(mode, mode)}"
        notes = ["ratio columns: our time / theirs (below 1: ours is faster)"]
        if COPY in present:
            notes.append("ours/copy: over a device copy of the same bytes in this run")
        if "ours_ip" in present:
            notes += ["ip: ours in place (out=x, residual_out=residual)"] + [
                f"{n}: {DESCRIPTIONS[n]}" for n in present if n in IN_PLACE_PEERS]
        g = geomean(to_best)
        if g is not None:
            notes.append(f"geomean ours / best peer: {g:.3f}; ours at or below the best peer "
                         f"at {wins} of {len(to_best)} shapes")
        if to_copy:
            worst = max(to_copy)
            notes.append(f"ours / copy at the {len(to_copy)} large shapes (tokens x hidden >= 4096 x 4096): "
                         f"geomean {geomean([r for r, _ in to_copy]):.3f}, max {worst[0]:.3f} ({worst[1]})")
        left = (0, headers.index("vs best peer"), len(headers) - 1)
        table = render_table(headers, rows, left=left, markdown=markdown)
        blocks.append(f"## {title}\n\n{table}\n\n" + "\n".join(f"- {n}" for n in notes) if markdown else
                      f"== {title}\n{table}\n" + "\n".join(f"   {n}" for n in notes))
    return "\n\n".join(blocks)


def format_copy_bandwidth(meta):
    if not meta.get("copy_GBps"):
        return ""
    return (f"copy bandwidth: {meta['copy_GBps']:.0f} GB/s (device-to-device memcpy of "
            f"{meta.get('copy_bytes', 0) >> 20} MiB, bytes read + written): the ceiling")


def format_first_call(first_call):
    lines = []
    for fc in first_call or []:
        what = f"{OP_TITLES.get(fc.get('op'), fc.get('op'))} {fc.get('tokens')}x{fc.get('hidden')} {fc.get('dtype')}"
        if "error" in fc:
            lines.append(f"first call, {what}: {fc['error']}")
        else:
            lines.append(f"first call in a fresh process, {what}: empty kernel cache "
                         f"{fc['empty_cache_ms']:.0f} ms, warm cache {fc['warm_cache_ms']:.1f} ms "
                         f"(second call {fc['second_call_ms']:.2f} ms)")
    return "\n".join(lines)


def format_markdown(payload):
    """The Markdown report: the console report's parts, its tables in Markdown."""
    meta = payload.get("meta", {})
    parts = [f"# Forward: {(meta.get('device') or {}).get('gpu', '?')}",
             format_header(meta).replace("\n", "  \n"), format_copy_bandwidth(meta),
             format_first_call(payload.get("first_call")).replace("\n", "  \n"),
             format_tables(payload.get("results", []), markdown=True)]
    return "\n\n".join(p for p in parts if p) + "\n"


# -- files ------------------------------------------------------------------------------------------
def csv_records(payload):
    """The records, the launch plan's fields as plan_* columns."""
    return [{**{k: v for k, v in r.items() if k != "plan"}, **{f"plan_{k}": v for k, v in (r.get("plan") or {}).items()}}
            for r in payload["results"]]


CHART_MODES = ("graph", "cold")


def chart_impls(impls):
    """The lines a chart draws from ``impls``, in IMPLS order: the out-of-place ones and the
    copy of the same bytes (dashed); the in-place form compares with its kind, in the tables."""
    return [n for n in _order(sorted(impls), IMPLS) if n not in IN_PLACE]


def write_charts(payload, stem, modes=CHART_MODES):
    """GB/s against tokens: one PNG per mode and dtype (``stem_MODE_DTYPE.png``), a row of
    panels per op, a panel per swept hidden size, a line per implementation, the copy
    bandwidth as the ceiling. Returns the paths written."""
    from matplotlib.figure import Figure
    records, copy_gbps = payload["results"], payload["meta"].get("copy_GBps")
    paths = []
    for mode in modes:
        for dtype in _order([r["dtype"] for r in records if r["mode"] == mode], ()):
            recs = [r for r in records if r["mode"] == mode and r["dtype"] == dtype]
            ops = _order([r["op"] for r in recs], OPS)
            tokens_by_hidden = {}
            for r in recs:
                tokens_by_hidden.setdefault(r["hidden"], set()).add(r["tokens"])
            hiddens = sorted(h for h, ts in tokens_by_hidden.items() if len(ts) >= 2) or sorted(tokens_by_hidden)
            fig = Figure(figsize=(5.2 * len(hiddens), 3.9 * len(ops)), layout="constrained")
            axes = fig.subplots(len(ops), len(hiddens), squeeze=False)
            for i, op in enumerate(ops):
                for j, hidden in enumerate(hiddens):
                    ax = axes[i][j]
                    sel = [r for r in recs if r["op"] == op and r["hidden"] == hidden]
                    for impl in chart_impls({r["impl"] for r in sel}):
                        pts = sorted((r["tokens"], r["GBps"]) for r in sel if r["impl"] == impl)
                        ours = impl in OURS
                        style = {"linestyle": "--", "color": "gray"} if impl == COPY else {}
                        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3,
                                linewidth=2.2 if ours else 1.1, zorder=3 if ours else 2,
                                label="copy of the same bytes" if impl == COPY else impl, **style)
                    if copy_gbps:
                        ax.axhline(copy_gbps, linestyle="--", color="black", linewidth=1,
                                   label=f"copy bandwidth ({copy_gbps:.0f} GB/s)")
                    ax.set_xscale("log", base=2)
                    ticks = sorted({r["tokens"] for r in sel})
                    ax.set_xticks(ticks)
                    ax.set_xticklabels([str(t) for t in ticks])
                    ax.minorticks_off()
                    ax.set_title(f"{OP_TITLES.get(op, op)}, hidden {hidden}", fontsize=10)
                    ax.set_xlabel("tokens")
                    ax.set_ylabel("GB/s")
                    ax.grid(alpha=0.3)
            axes[0][0].legend(fontsize=7, loc="upper left")
            fig.suptitle(f"{dtype}, {MODE_TITLES.get(mode, mode)}", fontsize=10)
            path = f"{stem}_{mode}_{dtype}.png"
            fig.savefig(path, dpi=110)
            paths.append(path)
    return paths


# -- a run's report ------------------------------------------------------------------------------
def format_report(payload):
    """The printed report of a run's payload (header, first calls, tables, errors)."""
    meta = payload.get("meta", {})
    parts = [format_header(meta), format_copy_bandwidth(meta), format_first_call(payload.get("first_call")),
             format_tables(payload.get("results", []))]
    errors = [e for e in payload.get("errors", []) if not e.get("skipped")]
    if errors:
        parts.append("errors:\n" + "\n".join(f"  {e['where']}: {e['error']}" for e in errors))
    return "\n\n".join(p for p in parts if p)
