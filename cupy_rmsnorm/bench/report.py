"""What every sub-command's report is made of: number formats, tables, the sectioned report,
JSON and CSV files. No CuPy or torch import: reports are read and written without a GPU.
"""

import csv
import json
import math
import statistics
import sys
from typing import Callable, NamedTuple

DIRTY_WARNING = ("WARNING: measured from a tree with uncommitted changes: this report does not match its "
                 "commit; re-run from a clean tree before committing it")


def unique(items):
    """Items in first-seen order, duplicates dropped."""
    return list(dict.fromkeys(items))


# -- text -------------------------------------------------------------------------------------------
def log(message):
    print(message, file=sys.stderr, flush=True)


def error_text(e, limit=300):
    return " ".join(f"{type(e).__name__}: {e}".split())[:limit]


def fmt_us(v):
    if v is None:
        return "-"
    return f"{v:.2f}" if v < 10 else f"{v:.1f}" if v < 1000 else f"{v:.0f}"


def fmt_num(v, digits=2):
    return "-" if v is None else f"{v:.{digits}f}"


def spread(values):
    """Median, min, max and quartiles (inclusive method) of a list, or None when empty."""
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    q1 = q3 = values[0]
    if len(values) > 1:
        q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return {"median": statistics.median(values), "min": values[0], "max": values[-1],
            "q1": q1, "q3": q3, "n": len(values)}


def geomean(values):
    values = [v for v in values if v and v > 0 and math.isfinite(v)]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def render_table(headers, rows, left=(0,), markdown=False):
    """A text or Markdown table, cells as formatted; ``left`` columns left-aligned."""
    from tabulate import tabulate
    align = [None if markdown else ("left" if i in left else "right") for i in range(len(headers))]
    return tabulate(rows, headers, tablefmt="github" if markdown else "simple", disable_numparse=True,
                    colalign=None if markdown else align)


def timing_cells(us, impls, peers):
    """Each implementation's microseconds, then ours over the best of ``peers`` and over the copy."""
    ours, measured = us.get("ours"), [us[i] for i in peers if us.get(i) is not None]
    return ([fmt_num(us.get(i)) for i in impls]
            + [fmt_num(ours / min(measured) if ours and measured else None, 3),
               fmt_num(ours / us["copy"] if ours and us.get("copy") else None, 3)])


def notes(payload):
    """What a run left out, what failed and what else it noted, a line each."""
    return ([f"skipped {k}: {v}" for k, v in payload.get("skipped", {}).items()]
            + [f"error: {e['where']}: {e['error']}" for e in payload.get("errors", []) if not e.get("skipped")]
            + [f"note: {n}" for n in payload.get("notes", [])])


def format_header(meta):
    """The lines every report starts with: device, commit, versions."""
    device = meta.get("device") or {}
    lines = []
    if device.get("gpu"):
        line = f"GPU: {device['gpu']}"
        if device.get("sm_count"):
            line += (f" ({device['sm_count']} SMs, compute capability {device.get('compute_capability', '?')})"
                     f", driver {device.get('driver_version') or '?'}, CUDA driver API "
                     f"{device.get('cuda_driver_api', '?')}")
        lines.append(line)
    commit = meta.get("commit")
    if commit:
        lines.append(f"commit: {commit}{' (uncommitted changes)' if meta.get('dirty') else ''}"
                     + (f", {meta['date']}" if meta.get("date") else ""))
    elif "commit" in meta:
        lines.append("commit: not recorded" + (f" ({meta['note']})" if meta.get("note") else ""))
    if meta.get("versions"):
        lines.append("versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()))
    if meta.get("dirty"):
        lines.append(DIRTY_WARNING)
    return "\n".join(lines)


def worst_err(record):
    """The largest of a record's ``err`` values as text (``nan`` where one is NaN, ``-`` where none)."""
    errs = [float(v) for v in record.get("err", {}).values() if v is not None]
    if not errs:
        return "-"
    return f"{float('nan') if any(math.isnan(e) for e in errs) else max(errs):.1e}"


def best_peer_summary(results, peers):
    """Geometric mean of ours / the best of ``peers`` over the records where both ran."""
    ratios = [r["us"]["ours"] / min(r["us"][i] for i in peers if r["us"].get(i)) for r in results
              if r["us"].get("ours") and any(r["us"].get(i) for i in peers)]
    return f"geomean ours / best peer: {geomean(ratios):.3f} over {len(ratios)} cases" if ratios else ""


def sections_of(results, ops, modes, op_key="op"):
    """{(op, mode, dtype): its records}, in ``ops`` and ``modes`` order."""
    keys = unique((r[op_key], r["mode"], r["dtype"]) for r in results)
    keys.sort(key=lambda k: (ops.index(k[0]), modes.index(k[1])))
    return {k: [r for r in results if (r[op_key], r["mode"], r["dtype"]) == k] for k in keys}


class SectionedReport(NamedTuple):
    """A report of a table per (pass, mode, dtype), sections in ``op_titles`` and ``modes`` order."""
    heading: str
    note: str
    headers: list
    left: tuple
    rows: Callable
    op_titles: dict
    modes: tuple
    peers: tuple
    op_key: str = "op"


def section_title(spec, key):
    op, mode, dtype = key
    return f"{spec.op_titles[op]}, {mode} mode, {dtype}: GPU microseconds per call (medians)"


def render_report(payload, heading, intro, sections, markdown=False):
    """A report as text or Markdown: header, ``intro``, a table per (title, headers, rows, left, summary), notes."""
    meta = payload["meta"]
    if markdown:
        parts = [f"# {heading}: {(meta.get('device') or {}).get('gpu', '?')}",
                 format_header(meta).replace("\n", "  \n"), *intro]
        for title, headers, rows, _, summary in sections:
            parts += [f"## {title}", render_table(headers, rows, markdown=True), summary]
        parts.append("\n".join(f"- {n}" for n in notes(payload)))
        return "\n\n".join(p for p in parts if p) + "\n"
    parts = [format_header(meta), "; ".join(intro)]
    for title, headers, rows, left, summary in sections:
        parts.append(f"== {title}\n{render_table(headers, rows, left=left)}" + (f"\n{summary}" if summary else ""))
    parts.append("\n".join(notes(payload)))
    return "\n\n".join(p for p in parts if p)


def sectioned_report(spec, payload, markdown=False):
    """The report of a table per (pass, mode, dtype) section, each with its best-peer summary."""
    intro = [f"copy bandwidth: {payload['meta'].get('copy_GBps', 0):.0f} GB/s", spec.note]
    sections = [(section_title(spec, key), spec.headers, spec.rows(rows), spec.left,
                 best_peer_summary(rows, spec.peers))
                for key, rows in sections_of(payload["results"], tuple(spec.op_titles), spec.modes, spec.op_key).items()]
    return render_report(payload, spec.heading, intro, sections, markdown)


# -- files --------------------------------------------------------------------------------------------
def _json_safe(obj):
    """NaN and infinities as strings (JSON has none); everything else as is."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def write_json(path, payload):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(_json_safe(payload), f, indent=1, default=str)
        f.write("\n")


def load_json(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def csv_of(records, columns=None):
    """(header, rows) of flat records; ``columns``: {column: format spec or None}, default every key."""
    columns = columns or dict.fromkeys(k for r in records for k in r)
    return list(columns), [[r.get(k) if r.get(k) is None or spec is None else format(float(r[k]), spec)
                            for k, spec in columns.items()] for r in records]


def time_columns(impls, checked=()):
    """CSV columns: each implementation's microseconds (3 decimals), then each ``checked`` one's error."""
    return {**{f"{i}_us": ".3f" for i in impls}, **{f"{i}_err": ".3e" for i in checked}}


def flatten(record):
    """A record's nested dicts as columns named after the inner key: {"us": {"ours": 1}} -> {"ours_us": 1}."""
    out = {}
    for key, value in record.items():
        if isinstance(value, dict):
            out.update({f"{inner}_{key}": v for inner, v in value.items()})
        else:
            out[key] = value
    return out


def write_csv(path, header, rows):
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(["" if v is None else v for v in row] for row in rows)
