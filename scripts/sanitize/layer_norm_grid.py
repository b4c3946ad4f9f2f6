"""A small, representative grid of LayerNorm calls for compute-sanitizer (scripts/sanitize.sh).

    PYTHONPATH=$PWD python3 scripts/sanitize/layer_norm_grid.py [--quick]

The forward (plain, fused, modulated by (B,1,D), (B,S,D) and (D,) shifts and scales) and the
backward over every dtype, row lengths from warp groups to a block of 1024 threads, vector
widths down to one element (rows one element past their allocation's start), strided rows,
weight and bias of x's dtype, float32 or absent; row counts large enough that the backward's
blocks loop over rows and its partial rows are reduced by the second kernel. Outputs are
never initialized (initcheck sees a read of an unwritten element); results are checked
against the NumPy reference on the host. Exit status: 0 all right; 3 a result was wrong.
"""

import argparse
import itertools
import sys

import ml_dtypes
import numpy as np
import torch

import cupy_rmsnorm as rn

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
HIDDEN = (64, 255, 1152, 4096, 8192)
QUICK_HIDDEN = (64, 1152)


def host(t):
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def placed(shape, dtype, layout, rng):
    """A device tensor of ``shape``: contiguous, 'strided' (rows of a wider buffer) or 'offset'
    (one element past its allocation's start: vector width 1)."""
    values = torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(DTYPES[dtype])
    if layout == "contiguous":
        return values.cuda()
    if layout == "strided":
        buf = torch.empty(*shape[:-1], shape[-1] * 2, dtype=DTYPES[dtype], device="cuda")
        buf[..., :shape[-1]] = values.cuda()
        return buf[..., :shape[-1]]
    buf = torch.empty(values.numel() + 1, dtype=DTYPES[dtype], device="cuda")
    view = buf[1:].view(shape)
    view.copy_(values.cuda())
    return view


def same(got, want):
    return np.array_equal(np.ascontiguousarray(host(got)).view(np.uint8), np.ascontiguousarray(want).view(np.uint8))


def close(got, want):
    g, w = host(got).astype(np.float32), np.asarray(want, np.float32)
    return np.allclose(g, w, rtol=2e-2, atol=1e-2 * max(1.0, float(np.abs(w).max())))


def main():
    quick = "--quick" in sys.argv[1:]
    argparse.ArgumentParser().parse_known_args()
    rng = np.random.default_rng(0)
    wrong = []
    layouts = ("contiguous", "offset") if quick else ("contiguous", "strided", "offset")
    kinds = ("same", "none") if quick else ("same", "float32", "none")
    for dtype, hidden, layout, params in itertools.product(DTYPES, QUICK_HIDDEN if quick else HIDDEN, layouts, kinds):
        rows = 600 if hidden <= 1152 else 40
        x = placed((rows, hidden), dtype, layout, rng)
        r = placed((rows, hidden), dtype, "contiguous", rng)
        dy = placed((rows, hidden), dtype, layout, rng)
        pdtype = dtype if params == "same" else "float32"
        w = None if params == "none" else placed((hidden,), pdtype, "contiguous", rng)
        b = None if params == "none" else placed((hidden,), pdtype, "contiguous", rng)
        hx, hr, hdy, hw, hb = host(x), host(r), host(dy), None if w is None else host(w), None if b is None else host(b)
        tag = f"{dtype} {hidden} {layout} {params}"
        if not same(rn.layer_norm(x, w, b), rn.layer_norm(hx, hw, hb)):
            wrong.append(f"layer_norm {tag}")
        y, s = rn.fused_add_layer_norm(x, r, w, b)
        wy, ws = rn.fused_add_layer_norm(hx, hr, hw, hb)
        if not (same(y, wy) and same(s, ws)):
            wrong.append(f"fused {tag}")
        got, want = rn.layer_norm_backward(dy, x, w, b), rn.layer_norm_backward(hdy, hx, hw, hb)
        if not same(got[0], want[0]) or any((g is None) != (v is None) or (g is not None and not close(g, v))
                                            for g, v in zip(got[1:], want[1:])):
            wrong.append(f"backward {tag}")
        for mshape in ((rows // 20, 1, hidden), (rows // 20, 20, hidden), (hidden,)):
            xs, dys = x.view(rows // 20, 20, hidden), dy.view(rows // 20, 20, hidden)
            shift, scale = placed(mshape, dtype, "contiguous", rng), placed(mshape, dtype, "contiguous", rng)
            hs, hc = host(shift), host(scale)
            if not same(rn.layer_norm_modulate(xs, shift, scale, weight=w, bias=b),
                        rn.layer_norm_modulate(host(xs), hs, hc, weight=hw, bias=hb)):
                wrong.append(f"modulate {mshape} {tag}")
            got = rn.layer_norm_modulate_backward(dys, xs, shift, scale, weight=w, bias=b)
            want = rn.layer_norm_modulate_backward(host(dys), host(xs), hs, hc, weight=hw, bias=hb)
            if not same(got[0], want[0]) or any((g is None) != (v is None) or (g is not None and not close(g, v))
                                                for g, v in zip(got[1:], want[1:])):
                wrong.append(f"modulate backward {mshape} {tag}")
    torch.cuda.synchronize()
    for line in wrong:
        print("WRONG", line)
    print(f"layer_norm_grid: {len(wrong)} wrong")
    return 3 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
