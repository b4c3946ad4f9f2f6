"""Compare benchmark runs of two versions of the library measured on one machine.

    python3 scripts/compare_bench.py --base OLD.json [OLD2.json ...] --new NEW.json [NEW2.json ...]

The runs are ``python -m cupy_rmsnorm.bench`` JSON outputs. Per (op, dtype, shape, mode):
``ours`` of each version (the median over its runs), new / base, and each version's time
over the best peer of its own runs (the ratio that holds across machine drift); then the
geometric means. Prints a markdown table; ``--out FILE`` writes it too.
"""

import argparse
import json
import math
import statistics


def load(paths):
    """{(op, dtype, tokens, hidden, mode): {impl: [us, ...]}} over the runs."""
    times = {}
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for r in json.load(f)["results"]:
                key = (r["op"], r["dtype"], r["tokens"], r["hidden"], r["mode"])
                times.setdefault(key, {}).setdefault(r["impl"], []).append(r["us"])
    return times


# cupy_rmsnorm.bench.peers' OURS, IN_PLACE and COPY: no "best peer" (this script imports nothing)
NOT_PEERS = ("ours", "ours_torch", "ours_ip", "liger_ip", "copy")


def ours_and_peer(entry):
    """(median of ours, median of the best peer or None, that peer's name)."""
    ours = statistics.median(entry["ours"]) if "ours" in entry else None
    peers = {k: statistics.median(v) for k, v in entry.items() if k not in NOT_PEERS}
    if not peers:
        return ours, None, None
    name = min(peers, key=peers.get)
    return ours, peers[name], name


def geomean(values):
    values = [v for v in values if v]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", nargs="+", required=True, help="the old version's run JSON files")
    ap.add_argument("--new", nargs="+", required=True, help="the new version's run JSON files")
    ap.add_argument("--out", default=None, help="also write the table here")
    args = ap.parse_args()
    base, new = load(args.base), load(args.new)
    lines = ["| op | dtype | tokens x hidden | mode | base us | new us | new / base | base / best peer | "
             "new / best peer |", "|---|---|---|---|---|---|---|---|---|"]
    ratios, base_peer, new_peer = [], [], []
    for key in sorted(set(base) & set(new), key=lambda k: (k[4], k[0], k[1], k[3], k[2])):
        b, bp, _ = ours_and_peer(base[key])
        n, np_, peer = ours_and_peer(new[key])
        if b is None or n is None:
            continue
        ratios.append(n / b)
        bpr = b / bp if bp else None
        npr = n / np_ if np_ else None
        base_peer.append(bpr)
        new_peer.append(npr)
        op, dtype, tokens, hidden, mode = key
        fmt = (lambda v: f"{v:.3f}" if v else "-")
        lines.append(f"| {op} | {dtype} | {tokens} x {hidden} | {mode} | {b:.2f} | {n:.2f} | {n / b:.3f} | "
                     f"{fmt(bpr)} | {fmt(npr)}{f' ({peer})' if peer else ''} |")
    lines.append("")
    lines.append(f"geometric means over {len(ratios)} cases: new / base {geomean(ratios):.3f}; "
                 f"ours / best peer: base {geomean(base_peer):.3f}, new {geomean(new_peer):.3f}; "
                 f"new slower than base by more than 3%: {sum(r > 1.03 for r in ratios)} cases, "
                 f"faster by more than 3%: {sum(r < 0.97 for r in ratios)}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
