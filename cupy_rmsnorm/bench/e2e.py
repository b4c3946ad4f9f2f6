"""``e2e``: a whole model, HF's norms against ours and Liger's.

A randomly initialized transformers ``LlamaForCausalLM`` (``--model qwen3``:
``Qwen3ForCausalLM``, whose attention normalizes each query and key head; nothing
downloaded) generates greedily, in two modes:

- ``eager``: ``generate`` with the default dynamic cache, under ``torch.inference_mode()``;
- ``compiled``: ``generate(cache_implementation="static")``, for which transformers
  compiles the decode forward (torch.compile, ``mode="reduce-overhead"``: CUDA graphs;
  ``fullgraph=True`` unless ``--no-fullgraph``; a variant that breaks the graph is
  compiled again with breaks allowed, and its row marked). The prefill stays eager there.

The variants are the same weights with other RMSNorm modules: ``hf`` (the model's RMSNorm
as built), ``ours`` (``patch_hf_rmsnorm``), ``ours_fused`` (``patch_hf_rmsnorm(model,
fuse_residual=True)``: each residual add inside the norm that follows it), ``ours_qk``
(Qwen3 only: ``patch_hf_rmsnorm(model, fuse_qk_rope=True)``, q_norm, k_norm and the
rotation as one op) and ``liger`` (Liger-Kernel's RMSNorm only). Each is a copy of the
module tree that shares every weight, so the variants cost one model's memory.

Measured per (mode, variant), the variants interleaved (A B C D A B C D ...) against
machine drift: prefill = ``generate(max_new_tokens=1)``; decode per token =
``(T(N new tokens) - T(1)) / (N - 1)`` of the same round. Also: logits agreement with
``hf`` on one teacher-forced forward, the top-1 agreement of every variant (hf included)
with the same model run in float32 (how far any bfloat16 norm is from the exact result:
with random weights the logits are flat, and near ties flip on the last bit of a norm),
and the graph breaks ``torch._dynamo.explain`` finds in a whole-model forward.

The agreement has a floor: ``hf`` itself with its mean of squares taken in float64 and
rounded to float32 (the most accurate float32 variance there is; every other op as HF
writes it) moves the variance by its last bits only, as any other reduction order does.
How often that flips a top-1 token against ``hf`` is what the check can tell at all
(reported as "agreement floor"; the same module with the float32 mean must give ``hf``'s
logits bit for bit, which the run checks).

The pure parts (arguments, order, statistics, tables) need neither torch nor a GPU and
are tested on a CPU; a hidden ``--device cpu`` runs the ``hf`` variant on a CPU to
smoke the harness.
"""

import argparse
import copy
import functools
import importlib
import itertools
import sys
import time
from typing import NamedTuple

from . import common, serving

SUMMARY = "a whole Llama- or Qwen3-shaped model generating, with HF's, our and Liger's norms"


class Family(NamedTuple):
    """A transformers model family the benchmark builds: where its classes live, its RMSNorm
    class, Liger's patch for it, and its MLP size (the real model's at 4096 wide)."""
    title: str
    modeling: str
    config: str
    model: str
    norm: str
    liger_patch: str
    intermediate: int
    qk_norms: bool           # per-head q_norm and k_norm in its attention (fuse_qk_rope applies)


FAMILIES = {
    "llama": Family("Llama", "transformers.models.llama.modeling_llama", "LlamaConfig", "LlamaForCausalLM",
                    "LlamaRMSNorm", "apply_liger_kernel_to_llama", 14336, False),
    "qwen3": Family("Qwen3", "transformers.models.qwen3.modeling_qwen3", "Qwen3Config", "Qwen3ForCausalLM",
                    "Qwen3RMSNorm", "apply_liger_kernel_to_qwen3", 12288, True),
}
HF_NORMS = {f.norm for f in FAMILIES.values()}

VARIANTS = ("hf", "ours", "ours_fused", "ours_qk", "liger")
VARIANT_TITLES = {
    "hf": "transformers' RMSNorm of the model (LlamaRMSNorm, Qwen3RMSNorm), as built",
    "ours": "cupy_rmsnorm.torch.patch_hf_rmsnorm(model)",
    "ours_fused": "cupy_rmsnorm.torch.patch_hf_rmsnorm(model, fuse_residual=True): each residual add "
                  "inside the norm that follows it, as one fused op (the MLP add with the next layer's "
                  "input norm, or the final norm)",
    "ours_qk": "cupy_rmsnorm.torch.patch_hf_rmsnorm(model, fuse_qk_rope=True) (Qwen3): the norms patched, "
               "and each attention's q_norm, k_norm and rotation as one qk_norm_rope",
    "liger": "Liger-Kernel's RMSNorm only: apply_liger_kernel_to_llama / _qwen3(rms_norm=True, model=model), "
             "no rope / swiglu / cross-entropy patches",
}
MODES = ("eager", "compiled")
MODE_TITLES = {"eager": "generate(do_sample=False), dynamic cache, torch.inference_mode()",
               "compiled": "generate(cache_implementation='static'): decode forward under torch.compile "
                           "(reduce-overhead, CUDA graphs); prefill eager"}
BASELINE = "hf"
EPS = 1e-6
NORM_WEIGHT_STD = 0.1        # norm weights 1 + N(0, 0.1): at all-ones, llama and fp32 rounding agree
PREFILL_REPLAYS = 3          # a 2048-token forward runs for milliseconds: a few calls per sample
EXPLAIN_TOKENS = 16          # the graph-break count needs a forward, not a long one
COMPILE_ESTIMATE_S = 75.0    # one variant's compile, for the time budget (8-layer Llama on an H200)
RECOMPILE_LIMIT = 64         # variants share code objects: one Dynamo cache entry each
DEFAULTS = {"layers": 8, "hidden": 4096, "heads": 32, "kv_heads": 8, "vocab": 32000,
            "new_tokens": 64, "repeats": 5, "modes": ["eager"], "agree_tokens": 1024,
            "step_modes": list(serving.STEP_MODES), "step_batches": [1, 64], "prefill": 2048, "replays": 50}
QUICK = {"layers": 2, "new_tokens": 16, "repeats": 2, "modes": ["eager"], "agree_tokens": 256,
         "step_modes": ["eager"], "step_batches": [1], "prefill": 512, "replays": 10}


class Skipped(Exception):
    """This variant cannot run here (not installed, no such keyword, no CUDA): reported, not an error."""


# -- arguments ------------------------------------------------------------------------------------
EPILOG = ("variants:\n" + "\n".join(f"  {k:11s} {v}" for k, v in VARIANT_TITLES.items())
          + "\n\nmodes:\n" + "\n".join(f"  {k:11s} {v}" for k, v in MODE_TITLES.items())
          + f"\n\nneeds torch with CUDA and transformers ({common.INSTALL_HINTS['transformers']}); liger: "
          + f"{common.INSTALL_HINTS['liger']}\n\n{common.PEERS_HELP}")


def add_arguments(p):
    common.add_common_options(p, modes=(MODES, "eager; the decode step's compiled form is in --step-modes"),
                              repeats="interleaved rounds over the variants, per mode (default: 5; --quick: 2)",
                              charts=False)
    positive = common.positive_int
    p.add_argument("--model", choices=tuple(FAMILIES), default="llama",
                   help="the model's family: llama, or qwen3 (per-head q/k norms; the ours_qk variant) "
                        "(default: llama)")
    p.add_argument("--layers", type=positive, help="decoder layers (default: 8; --quick: 2)")
    p.add_argument("--hidden", type=positive, help="hidden size (default: 4096)")
    p.add_argument("--intermediate", type=positive,
                   help="MLP intermediate size (default: Llama 14336, Qwen3 12288)")
    p.add_argument("--heads", type=positive, help="attention heads (default: 32)")
    p.add_argument("--kv-heads", type=positive, help="key/value heads (default: 8)")
    p.add_argument("--vocab", type=positive, help="vocabulary size (default: 32000)")
    p.add_argument("--dtype", type=common.argparse_type(common.parse_dtype), default="bfloat16",
                   help="the model's dtype: bf16, fp16 or fp32 (default: bf16)")
    p.add_argument("--batch", type=positive, default=1, help="prompts per generate call (default: 1)")
    p.add_argument("--prompt", type=positive, default=128, help="prompt tokens (default: 128)")
    p.add_argument("--new-tokens", type=positive,
                   help="tokens generated per timed call, at least 2 (default: 64; --quick: 16)")
    p.add_argument("--variants", type=common.comma_list(str.lower, VARIANTS, "variant"),
                   help=f"a list of {', '.join(VARIANTS)} (default: all the model has: ours_qk needs "
                        f"--model qwen3; hf always runs, as the reference)")
    p.add_argument("--agree-tokens", type=positive,
                   help="tokens of the teacher-forced forward that checks the logits (default: 1024; --quick: 256)")
    p.add_argument("--agree-batch", type=positive, default=4,
                   help="sequences of --agree-tokens each in that forward (default: 4)")
    p.add_argument("--step-modes", type=common.comma_list(str.lower, serving.STEP_MODES, "step mode"),
                   help="forms of the timed decode step: eager, compiled (default: both; --quick: eager)")
    p.add_argument("--compile-variants", type=common.comma_list(str.lower, VARIANTS, "variant"),
                   help="the variants whose compiled decode step is timed (each is a compile of the whole "
                        "model per batch; default: all)")
    p.add_argument("--step-batches", type=common.comma_list(common.positive_int, what="batch"),
                   help="sequences per decode step (default: 1,64; --quick: 1)")
    p.add_argument("--context", type=positive, default=512,
                   help="the decode step's position in its static cache (default: 512)")
    p.add_argument("--prefill", type=positive, help="tokens of the timed prefill (default: 2048; --quick: 512)")
    p.add_argument("--replays", type=positive,
                   help="CUDA graph replays per timed decode step sample (default: 50; --quick: 10)")
    p.add_argument("--no-fullgraph", action="store_true",
                   help="compile with graph breaks allowed (default: fullgraph=True, a break is an error)")
    p.add_argument("--budget-s", type=float, default=None, metavar="S",
                   help="start no compile and no round that would end past S seconds from the start "
                        "(what is left out is reported; default: no limit)")
    p.add_argument("--seed", type=int, default=0, help="weights and token ids (default: 0)")
    # "cpu": the hf variant alone, to smoke the harness without a GPU
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help=argparse.SUPPRESS)


def finish_args(args, p):
    common.resolve_defaults(args, DEFAULTS, QUICK)
    family = FAMILIES[args.model]
    if args.intermediate is None:
        args.intermediate = family.intermediate
    if args.variants is None:
        args.variants = [v for v in VARIANTS if v != "ours_qk" or family.qk_norms]
    if args.new_tokens < 2:
        p.error("--new-tokens must be at least 2 (decode time is T(N) - T(1) over N - 1 tokens)")
    if args.hidden % args.heads:
        p.error(f"--hidden {args.hidden} is not a multiple of --heads {args.heads}")
    if args.heads % args.kv_heads:
        p.error(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")
    if BASELINE not in args.variants:       # every comparison is against it
        args.variants = [BASELINE] + args.variants


def requirements_missing(args):
    why = common.torch_missing() if args.device == "cuda" else None
    return why or common.module_missing("transformers", "transformers", "transformers")


def model_config(args):
    """The config keywords (LlamaConfig's, Qwen3Config's) of this run."""
    return {"vocab_size": args.vocab, "hidden_size": args.hidden, "intermediate_size": args.intermediate,
            "head_dim": args.hidden // args.heads, "num_hidden_layers": args.layers, "num_attention_heads": args.heads,
            "num_key_value_heads": args.kv_heads, "rms_norm_eps": EPS,
            "max_position_embeddings": max(2048, args.prompt + args.new_tokens, args.agree_tokens,
                                           args.context + 1, args.prefill),
            "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


# -- order, statistics ------------------------------------------------------------------------------
def interleaved_order(variants, repeats):
    """[(round, variant)]: every variant once per round, rounds one after the other
    (A B C D A B C D ...), so slow drift of the machine spreads over all of them."""
    return [(r, v) for r in range(repeats) for v in variants]


def decode_ms_per_token(one_s, many_s, new_tokens):
    """Milliseconds per decoded token from generate's time for 1 and for ``new_tokens``
    tokens: the prefill and generate's fixed costs cancel out."""
    return (many_s - one_s) * 1e3 / (new_tokens - 1)


def summarize(timings, new_tokens, batch):
    """One row per (mode, variant) with a measurement: prefill and decode spreads, and
    the decode and prefill medians relative to the baseline of the same mode."""
    by_key = {}
    for t in timings:
        by_key.setdefault((t["mode"], t["variant"]), {}).setdefault(t["round"], {})[t["new_tokens"]] = t["seconds"]
    rows = []
    for (mode, variant), rounds in by_key.items():
        prefill = [r[1] * 1e3 for r in rounds.values() if 1 in r]
        decode = [decode_ms_per_token(r[1], r[new_tokens], new_tokens) for r in rounds.values()
                  if 1 in r and new_tokens in r]
        d = common.spread(decode)
        rows.append({"mode": mode, "variant": variant, "prefill_ms": common.spread(prefill), "decode_ms": d,
                     "tokens_per_s": batch * 1e3 / d["median"] if d and d["median"] > 0 else None})
    for row in rows:
        base = next((b for b in rows if b["mode"] == row["mode"] and b["variant"] == BASELINE), {})
        row["prefill_vs_hf"] = _median_ratio(row["prefill_ms"], base.get("prefill_ms"))
        row["decode_vs_hf"] = _median_ratio(row["decode_ms"], base.get("decode_ms"))
    order = {(m, v): i for i, (m, v) in enumerate(itertools.product(MODES, VARIANTS))}
    return sorted(rows, key=lambda r: order.get((r["mode"], r["variant"]), len(order)))


def _median_ratio(a, b):
    return a["median"] / b["median"] if a and b and b["median"] else None


def counter_delta(before, after):
    """What grew between two flat counter snapshots ({key: count})."""
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def graph_count_of(delta):
    return delta.get("stats.unique_graphs", 0)


def fits_budget(elapsed_s, needed_s, budget_s):
    """Whether a step of about ``needed_s`` seconds still ends within the budget."""
    return budget_s is None or elapsed_s + needed_s <= budget_s


# -- the tables --------------------------------------------------------------------------------------
def _ms(v):
    if v is None:
        return "-"
    return f"{v:.3f}" if v < 1 else f"{v:.2f}" if v < 100 else f"{v:.0f}"


def _range(s):
    return f"{_ms(s['min'])}-{_ms(s['max'])}" if s else "-"


def _ratio(v):
    return f"{v:.3f}" if v is not None else "-"


def _cell(a, key, spec):
    return format(a[key], spec) if a.get(key) is not None else "-"


def _agree_cells(a):
    """top-1 agreement and max |dlogit| against hf, then the same against float32."""
    a = a or {}
    return [_cell(a, "top1_agree", ".4f"), _cell(a, "max_abs_diff", ".3g"), _cell(a, "top1_vs_fp32", ".4f"),
            _cell(a, "max_abs_vs_fp32", ".3g")]


AGREEMENT_HEADERS = ["variant", "top-1 agree", "max abs dlogit", "logits differing", "norm outputs differing",
                     "norm max ulps", "top-1 vs fp32", "max abs vs fp32"]
FLOOR_VARIANT = "floor: hf, mean in float64"


def agreement_rows(payload):
    """The bits table: per variant (and the floor) its logits and its norm outputs against hf's."""
    found = dict(payload.get("agreement") or {})
    if payload.get("agreement_floor"):
        found[FLOOR_VARIANT] = payload["agreement_floor"]
    if not any("norm_outputs_differing" in a for a in found.values()):
        return []                     # a report from before the norm outputs were compared
    return [[name, _cell(a, "top1_agree", ".4f"), _cell(a, "max_abs_diff", ".3g"),
             _cell(a, "logits_differing", ".2%"), _cell(a, "norm_outputs_differing", ".4%"),
             _cell(a, "norm_max_ulps", ".3g"), _cell(a, "top1_vs_fp32", ".4f"), _cell(a, "max_abs_vs_fp32", ".3g")]
            for name, a in found.items()]


def _breaks_cell(breaks, compiled):
    """Explain's graph-break count; ``*`` when the timed compile allowed graph breaks."""
    if not breaks:
        return "-"
    text = "error" if breaks.get("error") else str(breaks["graph_break_count"])
    return text + ("*" if compiled and not compiled.get("fullgraph", True) else "")


BREAKS_FOOTNOTE = "*: timed with graph breaks allowed (compiled with fullgraph=False)"
TABLE_HEADERS = ["mode", "variant", "prefill ms", "min-max", "vs hf", "decode ms/token", "min-max", "vs hf",
                 "tokens/s", "top-1 agree", "max abs dlogit", "top-1 vs fp32", "max abs vs fp32", "graph breaks"]


def table_rows(payload):
    """The cells of the table, one row per summary row (mode, variant)."""
    out = []
    for r in payload["results"]:
        v = r["variant"]
        compiled = r["mode"] == "compiled"
        breaks = _breaks_cell(payload.get("graph_breaks", {}).get(v),
                              payload.get("compile", {}).get(f"compiled {v}")) if compiled else "-"
        out.append([r["mode"], v, _ms(r["prefill_ms"] and r["prefill_ms"]["median"]), _range(r["prefill_ms"]),
                    _ratio(r["prefill_vs_hf"]), _ms(r["decode_ms"] and r["decode_ms"]["median"]),
                    _range(r["decode_ms"]), _ratio(r["decode_vs_hf"]),
                    f"{r['tokens_per_s']:.1f}" if r["tokens_per_s"] else "-",
                    *_agree_cells(payload.get("agreement", {}).get(v)),
                    breaks])
    return out


def describe(meta):
    c = meta["config"]
    family = FAMILIES[meta.get("model", "llama")].title
    return (f"{family} {c['num_hidden_layers']} layers x {c['hidden_size']} (intermediate {c['intermediate_size']}, "
            f"{c['num_attention_heads']}/{c['num_key_value_heads']} heads, vocab {c['vocab_size']}), "
            f"{meta['dtype']}, batch {meta['batch']}, prompt {meta['prompt']}, {meta['new_tokens']} new tokens, "
            f"{meta['repeats']} interleaved rounds, on {(meta.get('device') or {}).get('gpu', '?')}")


def floor_line(payload):
    """The agreement floor in words, or None when it was not measured."""
    f = payload.get("agreement_floor")
    if not f:
        return None
    line = (f"agreement floor (hf with its mean of squares in float64, rounded once, vs hf): top-1 "
            f"{f['top1_agree']:.4f}, max abs dlogit {f['max_abs_diff']:.3g}")
    if "top1_vs_fp32" in f:
        line += f"; vs fp32: top-1 {f['top1_vs_fp32']:.4f}, max abs {f['max_abs_vs_fp32']:.3g}"
    return line + f"; hf's arithmetic reimplemented: max abs dlogit {f['reimplementation_max_abs_diff']:.3g}"


def format_report(payload):
    """The console report: what ran, what was left out, then the table (the last lines)."""
    meta, rows = payload["meta"], payload["results"]
    lines = [f"e2e: {describe(meta)}", common.format_header(meta),
             ("prefill: generate(max_new_tokens=1); decode: (T(N) - T(1)) / (N - 1) of one round; "
              "median and min-max over rounds; agreement: teacher-forced logits vs hf, and top-1 vs the "
              "model in float32")]
    for name, why in payload.get("skipped", {}).items():
        lines.append(f"skipped: {name}: {why}")
    for e in payload.get("errors", []):
        lines.append(f"error: {e['where']}: {e['error']}")
    for note in payload.get("notes", []):
        lines.append(f"note: {note}")
    floor = floor_line(payload)
    if floor:
        lines.append(floor)
    steps = serving_rows(payload)
    if steps:
        lines += ["", serving_line(meta), common.render_table(serving.TABLE_HEADERS, serving.table_rows(steps),
                                                              left=(0, 2, 3))]
    bits = agreement_rows(payload)
    if bits:
        lines += ["", AGREEMENT_LINE, common.render_table(AGREEMENT_HEADERS, bits)]
    if rows:
        cells = table_rows(payload)
        lines += ["", GENERATE_LINE, common.render_table(TABLE_HEADERS, cells, left=(0, 1))]
        if any(c[-1].endswith("*") for c in cells):
            lines.append(BREAKS_FOOTNOTE)
    elif not steps:
        lines.append("nothing was measured")
    return "\n".join(lines)


def serving_rows(payload):
    return (payload.get("serving") or {}).get("results") or []


def serving_line(meta):
    return (f"GPU time of what a server runs: decode step at context {meta['context']} (static cache, one CUDA "
            f"graph replayed {meta['replays']} times per sample) and a prefill of {meta['prefill']} tokens; "
            f"microseconds, median and min-max over rounds")


AGREEMENT_LINE = ("agreement with hf on one teacher-forced forward: logits, and each norm module run on hf's "
                  "own input to it (its arithmetic alone, not what the model makes of it)")
GENERATE_LINE = "generate (the Python of transformers' loop included: about 2 ms a token)"


def format_markdown(payload):
    """A Markdown table for the README."""
    meta, rows = payload["meta"], payload["results"]
    steps = serving_rows(payload)
    if not rows and not steps:
        return ""
    unit = "Median" if steps else "Milliseconds, median"     # the serving table is in microseconds
    lines = [(f"End to end: {describe(meta)}. {unit} over rounds (min-max); "
              f"vs hf below 1: faster than with HF's norms."), "", common.format_header(meta).replace("\n", "  \n")]
    if steps:
        lines += ["", serving_line(meta) + ".", "", common.markdown_table(serving.TABLE_HEADERS, serving.table_rows(steps))]
    bits = agreement_rows(payload)
    if bits:
        lines += ["", AGREEMENT_LINE + ":", "", common.markdown_table(AGREEMENT_HEADERS, bits)]
    if not rows:
        return "\n".join(lines) + "\n"
    if steps:
        lines += ["", GENERATE_LINE + ", milliseconds:"]
    lines += ["", "| " + " | ".join(TABLE_HEADERS) + " |", "|" + "---|" * len(TABLE_HEADERS)]
    cells = table_rows(payload)
    lines += ["| " + " | ".join(c) + " |" for c in cells]
    if any(c[-1].endswith("*") for c in cells):
        lines += ["", BREAKS_FOOTNOTE]
    floor = floor_line(payload)
    if floor:
        lines += ["", floor[0].upper() + floor[1:] + "."]
    notes = [f"{k}: {v}" for k, v in payload.get("skipped", {}).items()]
    if notes:
        lines += ["", "Skipped: " + "; ".join(notes) + "."]
    return "\n".join(lines) + "\n"


CSV_FIELDS = ("mode", "variant", "prefill_ms", "prefill_ms_min", "prefill_ms_max", "prefill_ms_q1", "prefill_ms_q3",
              "decode_ms_per_token", "decode_ms_min", "decode_ms_max", "decode_ms_q1", "decode_ms_q3", "rounds",
              "decode_vs_hf", "prefill_vs_hf", "tokens_per_s", "top1_agree", "max_abs_logit_diff", "top1_vs_fp32",
              "max_abs_vs_fp32",
              "graph_breaks", "timed_fullgraph")


SERVING_CSV_FIELDS = ("measure", "batch", "mode", "variant", "us", "us_min", "us_max", "rounds", "vs_hf",
                      "vs_hf_compiled")


def csv_table(payload):
    out = []
    for r in payload["results"]:
        p, d = r["prefill_ms"] or {}, r["decode_ms"] or {}
        a = payload.get("agreement", {}).get(r["variant"]) or {}
        b = payload.get("graph_breaks", {}).get(r["variant"]) or {}
        compiled = payload.get("compile", {}).get(f"compiled {r['variant']}") or {}
        out.append({"mode": r["mode"], "variant": r["variant"],
                    "prefill_ms": p.get("median"), "prefill_ms_min": p.get("min"), "prefill_ms_max": p.get("max"),
                    "prefill_ms_q1": p.get("q1"), "prefill_ms_q3": p.get("q3"),
                    "decode_ms_per_token": d.get("median"), "decode_ms_min": d.get("min"),
                    "decode_ms_max": d.get("max"), "decode_ms_q1": d.get("q1"), "decode_ms_q3": d.get("q3"),
                    "rounds": d.get("n") or p.get("n"), "decode_vs_hf": r["decode_vs_hf"],
                    "prefill_vs_hf": r["prefill_vs_hf"], "tokens_per_s": r["tokens_per_s"],
                    "top1_agree": a.get("top1_agree"), "max_abs_logit_diff": a.get("max_abs_diff"),
                    "top1_vs_fp32": a.get("top1_vs_fp32"), "max_abs_vs_fp32": a.get("max_abs_vs_fp32"),
                    "graph_breaks": b.get("graph_break_count") if r["mode"] == "compiled" else None,
                    "timed_fullgraph": compiled.get("fullgraph") if r["mode"] == "compiled" else None})
    steps = serving_rows(payload)
    if not steps:
        return list(CSV_FIELDS), [[row[k] for k in CSV_FIELDS] for row in out]
    # a run with the serving measures: their rows first, each table's columns empty in the other's rows
    fields = list(SERVING_CSV_FIELDS) + [k for k in CSV_FIELDS if k not in SERVING_CSV_FIELDS]
    for row in out:
        row["measure"] = "generate"
    out = [{"measure": r["measure"], "batch": r["batch"], "mode": r["mode"], "variant": r["variant"],
            "us": r["us"]["median"], "us_min": r["us"]["min"], "us_max": r["us"]["max"], "rounds": r["us"]["n"],
            "vs_hf": r["vs_hf"], "vs_hf_compiled": r["vs_hf_compiled"]} for r in steps] + out
    return fields, [[row.get(k) for k in fields] for row in out]


# -- the measuring loop (torch-free: it gets the timing function) --------------------------------------
def measure_rounds(mode, variants, repeats, new_tokens, time_generate, log, clock=time.perf_counter,
                   deadline=None):
    """The interleaved rounds of one mode: per (round, variant) ``time_generate(variant, 1)``
    then ``time_generate(variant, new_tokens)`` (seconds each). A variant whose call
    raises drops out of the later rounds; a round that would end past ``deadline`` (a
    clock value, judged by the last round's length) is not started.

    Returns (timings, errors, notes)."""
    timings, errors, notes, failed = [], [], [], set()
    current, round_started = None, None
    for rnd, variant in interleaved_order(variants, repeats):
        if rnd != current:
            now = clock()
            if deadline is not None and round_started is not None and now + (now - round_started) > deadline:
                notes.append(f"{mode}: the time budget stopped the rounds after {rnd} of {repeats}")
                break
            current, round_started = rnd, now
        if variant in failed:
            continue
        try:
            for n in (1, new_tokens):
                seconds = time_generate(variant, n)
                timings.append({"mode": mode, "variant": variant, "round": rnd, "new_tokens": n,
                                "seconds": seconds})
        except Exception as e:  # noqa: BLE001 - one failing variant must not end the run
            failed.add(variant)
            timings = [t for t in timings if not (t["variant"] == variant and t["round"] == rnd)]
            errors.append({"where": f"{mode} {variant} round {rnd}", "error": _err_text(e)})
            log(f"error: {mode} {variant}: {_err_text(e)}")
    return timings, errors, notes


def _err_text(e):
    return common.error_text(e, limit=400)


# -- the model and its variants (torch from here on) ------------------------------------------------------
def build_model(args):
    """The random model of the run's family on the device, in the run's dtype (built under it
    as default dtype, as from_pretrained does: the rotary inv_freq stays float32), norm
    weights randomized (see NORM_WEIGHT_STD)."""
    import torch
    family = FAMILIES[args.model]
    modeling = importlib.import_module(family.modeling)
    torch.manual_seed(args.seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, args.dtype))
    try:
        with torch.device(args.device):
            config = getattr(modeling, family.config)(**model_config(args))
            model = getattr(modeling, family.model)(config).eval()
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        gen = torch.Generator(device=args.device).manual_seed(args.seed + 1)
        for m in model.modules():
            if is_hf_norm(m):
                m.weight.copy_(1.0 + NORM_WEIGHT_STD * torch.randn(m.weight.shape, generator=gen,
                                                                   device=args.device))
    return model


def shared_weight_copy(model):
    """A copy of the module tree that shares every parameter and buffer: patching it
    leaves ``model`` as it is and costs no weight memory."""
    memo = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    return copy.deepcopy(model, memo)


def apply_liger_rms_norm(model, family):
    """Liger's RMSNorm on ``model``'s norm modules, nothing else; returns how many."""
    try:
        import liger_kernel.transformers as liger
        patch = getattr(liger, family.liger_patch)
    except Exception as e:  # noqa: BLE001 - not installed, or Triton missing
        raise Skipped(f"liger_kernel is not importable ({_err_text(e)})") from None
    modeling = importlib.import_module(family.modeling)
    saved = getattr(modeling, family.norm)
    try:
        patch(rope=False, cross_entropy=False, fused_linear_cross_entropy=False, rms_norm=True, swiglu=False,
              model=model)
    finally:
        setattr(modeling, family.norm, saved)   # its class-level swap would reach models built later
    return sum(m._get_name() == "LigerRMSNorm" for m in model.modules())


# the keywords of patch_hf_rmsnorm each of our variants passes
PATCH_KEYWORDS = {"ours": {}, "ours_fused": {"fuse_residual": True}, "ours_qk": {"fuse_qk_rope": True}}


def make_variant(name, base, device, family):
    """(model, number of norm modules replaced) of one variant."""
    if name == BASELINE:
        return base, 0
    if name == "ours_qk" and not family.qk_norms:
        raise Skipped(f"{family.title} has no per-head q_norm / k_norm to fuse with the rotation (--model qwen3)")
    if device != "cuda":
        raise Skipped(f"needs CUDA (--device {device})")
    model = shared_weight_copy(base)
    if name == "liger":
        replaced = apply_liger_rms_norm(model, family)
    else:
        from cupy_rmsnorm.torch import patch_hf_rmsnorm
        keywords = PATCH_KEYWORDS[name]
        try:
            replaced = patch_hf_rmsnorm(model, **keywords)
        except TypeError as e:
            if not any(k in str(e) for k in keywords):
                raise
            raise Skipped(f"this cupy_rmsnorm's patch_hf_rmsnorm has no {', '.join(keywords)} keyword "
                          f"({_err_text(e)})") from None
        if name == "ours_qk" and not any(getattr(m, "_cupy_rmsnorm_qk_rope", None) for m in model.modules()):
            raise RuntimeError("fuse_qk_rope rewrote no attention module")
    if not replaced:
        raise RuntimeError("no norm module was replaced")
    return model, replaced


def modeling_fingerprint(family):
    """{name: identity} of the family's transformers classes, their forwards and functions: a
    variant's patch must change instances only, or hf would run the patch too."""
    modeling = importlib.import_module(family.modeling)
    out = {}
    for name, obj in vars(modeling).items():
        if isinstance(obj, type) or callable(obj):
            out[name] = (id(obj), id(vars(obj).get("forward")) if isinstance(obj, type) else None)
    return out


def token_ids(args, batch, length, offset):
    import torch
    gen = torch.Generator(device=args.device).manual_seed(args.seed + offset)
    return torch.randint(3, args.vocab, (batch, length), generator=gen, device=args.device)


def logits_of(model, ids):
    import torch
    with torch.inference_mode():
        return model(input_ids=ids, use_cache=False).logits.float()


def top1_agreement(logits, reference):
    return float((logits.argmax(-1) == reference.argmax(-1)).float().mean())


def against_exact(logits, exact):
    """How far a variant's logits are from the float32 model's: top-1 agreement, max |diff|."""
    return {"top1_vs_fp32": top1_agreement(logits, exact), "max_abs_vs_fp32": float((logits - exact).abs().max())}


def float32_logits(model, ids):
    """Logits of ``model`` run in float32 (a float32 copy, dropped after): the exact result
    that every bfloat16 variant approximates."""
    exact = copy.deepcopy(model).float()
    try:
        return logits_of(exact, ids)
    finally:
        del exact


def agreement(logits, reference):
    diff = (logits - reference).abs()
    return {"max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean()),
            "logits_differing": float((logits != reference).float().mean()),
            "top1_agree": top1_agreement(logits, reference),
            "reference_max_abs_logit": float(reference.abs().max())}


def is_hf_norm(module):
    return type(module).__name__ in HF_NORMS


def norm_calls(model, ids):
    """[(module path, input, output)] of every HF RMSNorm call in one teacher-forced forward
    of ``model`` (hf)."""
    calls = []

    def record(path):
        return lambda module, args, out: calls.append((path, args[0].detach(), out.detach()))
    handles = [m.register_forward_hook(record(path)) for path, m in model.named_modules() if is_hf_norm(m)]
    try:
        logits_of(model, ids)
    finally:
        for h in handles:
            h.remove()
    return calls


def ulps(values, reference):
    """|values - reference| in units of the last place of ``reference``'s dtype at each
    reference value (its smallest normal where the reference is smaller)."""
    import torch
    info = torch.finfo(reference.dtype)
    ref = reference.float()
    magnitude = ref.abs().clamp_min(info.tiny)
    unit = torch.exp2(torch.floor(torch.log2(magnitude))) * info.eps
    return (values.float() - ref).abs() / unit


def norm_agreement(model, calls):
    """How ``model``'s norm modules differ from hf's on hf's own inputs, call by call (so a
    difference is the norm's arithmetic, not its propagation through the model): the fraction
    of output elements whose bits differ, and the largest difference in units of the last
    place."""
    import torch
    modules = dict(model.named_modules())
    differing = total = 0
    worst = 0.0
    with torch.inference_mode():
        for path, x, want in calls:
            got = modules[path](x)
            got = (got[0] if isinstance(got, tuple) else got).to(want.dtype)
            differing += int((got != want).sum())
            total += want.numel()
            worst = max(worst, float(ulps(got, want).max()))
    return {"norm_outputs_differing": differing / total if total else 0.0, "norm_max_ulps": worst}


def _hf_norm_with_mean_in(mean_dtype, module, hidden_states):
    """LlamaRMSNorm's (and Qwen3RMSNorm's) forward, op for op, with the mean of squares taken in ``mean_dtype``
    (then float32): float32 reproduces HF's own bits, float64 rounds the variance once."""
    import torch
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.to(mean_dtype).pow(2).mean(-1, keepdim=True).to(torch.float32)
    hidden_states = hidden_states * torch.rsqrt(variance + module.variance_epsilon)
    return module.weight * hidden_states.to(input_dtype)


def with_norm_mean_in(base, mean_dtype):
    """A weight-sharing copy of ``base`` whose HF RMSNorm modules take their mean in ``mean_dtype``."""
    model = shared_weight_copy(base)
    replaced = 0
    for m in model.modules():
        if is_hf_norm(m):
            m.forward = functools.partial(_hf_norm_with_mean_in, mean_dtype, m)
            replaced += 1
    if not replaced:
        raise RuntimeError("no HF RMSNorm module found")
    return model


def agreement_floor(base, ids, reference, exact, calls=None):
    """The check's floor (module docstring): ``hf`` with its variance rounded once, against
    ``hf``; ``reimplementation_max_abs_diff`` (the float32-mean copy against ``hf``) is 0
    when the copy is HF's arithmetic."""
    import torch
    same = logits_of(with_norm_mean_in(base, torch.float32), ids)
    rounded_once_model = with_norm_mean_in(base, torch.float64)
    rounded_once = logits_of(rounded_once_model, ids)
    floor = agreement(rounded_once, reference)
    if calls is not None:
        floor.update(norm_agreement(rounded_once_model, calls))
    if exact is not None:
        floor.update(against_exact(rounded_once, exact))
    floor["reimplementation_max_abs_diff"] = float((same - reference).abs().max())
    return floor


def graph_breaks(model, ids):
    """Graph breaks of one whole-model forward under Dynamo (no compile). Note that
    explain resets Dynamo: it must run before anything is compiled."""
    import torch
    import torch._dynamo
    with torch.no_grad():
        out = torch._dynamo.explain(model)(input_ids=ids, use_cache=False)
    reasons = list(dict.fromkeys(" ".join(str(r.reason).split())[:300] for r in out.break_reasons))
    return {"graph_count": out.graph_count, "graph_break_count": out.graph_break_count,
            "break_reasons": reasons[:10]}


def dynamo_counters():
    """Dynamo's and Inductor's counters, flat ({"stats.unique_graphs": n, ...})."""
    from torch._dynamo.utils import counters
    return {f"{cat}.{key}": n for cat, c in counters.items() for key, n in c.items()}


def raise_recompile_limits():
    import torch._dynamo
    cfg = torch._dynamo.config
    for names in (("recompile_limit", "cache_size_limit"),
                  ("accumulated_recompile_limit", "accumulated_cache_size_limit")):
        for attr in names:
            if hasattr(cfg, attr):
                setattr(cfg, attr, max(getattr(cfg, attr), RECOMPILE_LIMIT))
                break


class TimedGenerate:
    """Timed ``generate`` calls of every variant in one mode."""

    def __init__(self, args, models, prompt, mode):
        import torch
        from transformers import CompileConfig, GenerationConfig
        self.torch, self.models, self.prompt, self.mode = torch, models, prompt, mode
        self.sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
        self.kwargs = {"attention_mask": torch.ones_like(prompt), "do_sample": False, "pad_token_id": 0}
        self.compile_configs = {}
        if mode == "compiled":
            self.kwargs["cache_implementation"] = "static"
            if hasattr(GenerationConfig(), "max_cache_len"):   # T(1) and T(N) share one cache size, one graph
                self.kwargs["max_cache_len"] = prompt.shape[1] + args.new_tokens
            for name in models:
                config = CompileConfig(fullgraph=not args.no_fullgraph)
                if args.device != "cuda":
                    config._compile_all_devices = True      # generate compiles on CUDA only, unless told
                self.compile_configs[name] = config

    def fullgraph(self, variant):
        config = self.compile_configs.get(variant)
        return bool(config and config.fullgraph)

    def allow_graph_breaks(self, variant):
        """Compile ``variant`` again with graph breaks allowed (a new config: a new torch.compile)."""
        from transformers import CompileConfig
        old = self.compile_configs[variant]
        new = CompileConfig(fullgraph=False)
        new._compile_all_devices = old._compile_all_devices
        self.compile_configs[variant] = new

    def __call__(self, variant, new_tokens):
        torch = self.torch
        kwargs = dict(self.kwargs, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
        if variant in self.compile_configs:
            kwargs["compile_config"] = self.compile_configs[variant]
        # eager: inference_mode, as a server runs; compiled: generate's own no_grad, as
        # transformers' compile path is used and tested (no inference tensors in the static cache)
        context = torch.inference_mode() if self.mode == "eager" else torch.no_grad()
        self.sync()
        t0 = time.perf_counter()
        with context:
            out = self.models[variant].generate(self.prompt, **kwargs)
        self.sync()
        seconds = time.perf_counter() - t0
        if out.shape[1] != self.prompt.shape[1] + new_tokens:
            raise RuntimeError(f"generated {out.shape[1] - self.prompt.shape[1]} tokens, not {new_tokens}")
        return seconds


def log(msg):
    common.log(msg)


def run(args):
    import torch  # noqa: F401 - loaded before the metadata, which then records torch's CUDA version
    started = time.perf_counter()
    deadline = None if args.budget_s is None else started + args.budget_s

    def elapsed():
        return time.perf_counter() - started

    device = common.gpu_device() if args.device == "cuda" else {"gpu": "cpu"}
    meta = common.run_metadata(
        "e2e", device, torch_device=args.device, model=args.model, config=model_config(args), dtype=args.dtype,
        batch=args.batch, prompt=args.prompt, new_tokens=args.new_tokens, repeats=args.repeats,
        agree_tokens=args.agree_tokens, agree_batch=args.agree_batch, modes=args.modes,
        variants={v: VARIANT_TITLES[v] for v in args.variants}, step_modes=args.step_modes,
        compile_variants=args.compile_variants, step_batches=args.step_batches, context=args.context,
        prefill=args.prefill, replays=args.replays,
        mode_titles={m: MODE_TITLES[m] for m in args.modes}, fullgraph=not args.no_fullgraph,
        norm_weights=f"1 + N(0, {NORM_WEIGHT_STD})", budget_s=args.budget_s)
    payload = {"meta": meta, "skipped": {}, "errors": [], "notes": [], "agreement": {}, "graph_breaks": {},
               "compile": {}, "timed_counters": {}, "timings": [], "results": []}
    interrupted = False
    try:
        measure_all(args, payload, elapsed, deadline)
    except KeyboardInterrupt:
        interrupted = True
        log("interrupted: saving what was measured")
    summarize_into(args, payload, elapsed)
    return common.finish_run(sys.modules[__name__], args, payload, interrupted)


def measure_all(args, payload, elapsed, deadline):
    """Model, variants, agreement, graph breaks, then each mode's warm-up and rounds,
    all into ``payload`` (written to disk after each mode)."""
    meta = payload["meta"]
    log(f"e2e on {meta['device']['gpu']}: building the model ...")
    base = build_model(args)
    meta["parameters"] = sum(p.numel() for p in base.parameters())
    meta["build_s"] = elapsed()

    family = FAMILIES[args.model]
    models, replaced = {}, {}
    for name in args.variants:
        before = modeling_fingerprint(family)
        try:
            models[name], replaced[name] = make_variant(name, base, args.device, family)
        except Skipped as e:
            payload["skipped"][name] = str(e)
            log(f"skipped: {name}: {e}")
        except Exception as e:  # noqa: BLE001 - one failing variant must not end the run
            payload["errors"].append({"where": f"patch {name}", "error": _err_text(e)})
            log(f"error: patch {name}: {_err_text(e)}")
        after = modeling_fingerprint(family)
        changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        if changed:
            where = family.modeling.rsplit(".", 1)[-1]
            payload["errors"].append({"where": f"patch {name}", "error": f"changed transformers' {where} "
                                      f"({', '.join(changed)}): hf and every variant run that change too"})
            log(f"error: patch {name} changed transformers' {where}: {', '.join(changed)}")
    meta["replaced_norms"] = replaced

    # Agreement: one teacher-forced forward per variant against hf's logits.
    ids = token_ids(args, args.agree_batch, args.agree_tokens, offset=2)
    reference = logits_of(models[BASELINE], ids)
    calls = norm_calls(models[BASELINE], ids)
    exact = None
    if args.dtype != "float32":
        try:
            exact = float32_logits(base, ids)
        except Exception as e:  # noqa: BLE001 - a float32 copy may not fit: the run goes on without it
            payload["notes"].append(f"no agreement with the float32 model: {_err_text(e)}")
            log(f"note: no agreement with the float32 model: {_err_text(e)}")
    if exact is not None:
        payload["agreement"][BASELINE] = against_exact(reference, exact)
    for name in [n for n in models if n != BASELINE]:
        try:
            logits = logits_of(models[name], ids)
            payload["agreement"][name] = agreement(logits, reference)
            payload["agreement"][name].update(norm_agreement(models[name], calls))
            if exact is not None:
                payload["agreement"][name].update(against_exact(logits, exact))
        except Exception as e:  # noqa: BLE001
            payload["errors"].append({"where": f"agreement {name}", "error": _err_text(e)})
            log(f"error: agreement {name}: {_err_text(e)}")
            del models[name]
    try:
        payload["agreement_floor"] = agreement_floor(base, ids, reference, exact, calls)
    except Exception as e:  # noqa: BLE001 - the floor is context, not a variant
        payload["errors"].append({"where": "agreement floor", "error": _err_text(e)})
        log(f"error: agreement floor: {_err_text(e)}")
    blind = payload.get("agreement_floor", {}).get("logits_differing") == 0.0
    if blind:
        payload["notes"].append(f"the agreement check is blind at this size: hf with its mean of squares in "
                                f"float64 gives hf's logits bit for bit over {args.agree_batch} x {args.agree_tokens} "
                                f"tokens; the norm outputs' bits (norm outputs differing) still tell variants apart")
    del reference, exact, calls

    if "compiled" in args.modes:   # explain resets Dynamo: before any compile
        short = ids[:, :EXPLAIN_TOKENS]
        for name, model in models.items():
            t0 = time.perf_counter()
            try:
                payload["graph_breaks"][name] = graph_breaks(model, short)
            except Exception as e:  # noqa: BLE001 - reported in the table as "error"
                payload["graph_breaks"][name] = {"error": _err_text(e)}
            payload["graph_breaks"][name]["seconds"] = time.perf_counter() - t0
            log(f"graph breaks of {name}: {payload['graph_breaks'][name].get('graph_break_count', 'error')}")
    if "compiled" in args.modes or "compiled" in args.step_modes:
        raise_recompile_limits()       # the variants share code objects: one Dynamo cache entry each

    measure_serving(args, payload, models, elapsed, deadline)
    common.save_partial(args, payload)

    prompt = token_ids(args, args.batch, args.prompt, offset=3)
    for mode in args.modes:
        generate = TimedGenerate(args, models, prompt, mode)
        ready = warm_up(mode, models, generate, args, payload, elapsed)
        log(f"{mode}: {args.repeats} rounds of {', '.join(ready)} ...")
        before = dynamo_counters()
        timings, errors, notes = measure_rounds(mode, ready, args.repeats, args.new_tokens, generate, log,
                                                deadline=deadline)
        timed = counter_delta(before, dynamo_counters())
        payload["timed_counters"][mode] = timed
        grew = graph_count_of(timed)
        if grew:
            notes.append(f"{mode}: {grew} graphs were compiled during the timed rounds (recompiles): "
                         f"their times include that")
        payload["timings"] += timings
        payload["errors"] += errors
        payload["notes"] += notes
        for note in notes:
            log(f"note: {note}")
        summarize_into(args, payload, elapsed)
        common.save_partial(args, payload)     # a later crash keeps this mode's results


def measure_serving(args, payload, models, elapsed, deadline):
    """The decode steps and the prefill of every variant (the serving module), captured or
    warmed up one by one, then timed in interleaved rounds."""
    timers = {}
    prefill_ids = token_ids(args, 1, args.prefill, offset=4)
    for measure, mode, batch in serving.measures(args.step_modes, args.step_batches, args.prefill):
        for name, model in models.items():
            key = (measure, mode, batch, name)
            where = " ".join(map(str, key))
            if mode == "compiled" and args.compile_variants is not None and name not in args.compile_variants:
                payload["skipped"][f"serving {where}"] = "not in --compile-variants"
                continue
            if mode == "compiled" and args.device != "cuda":
                payload["skipped"][f"serving {where}"] = "compiled steps run on CUDA only"
                continue
            if mode == "compiled" and not fits_budget(elapsed(), COMPILE_ESTIMATE_S, args.budget_s):
                payload["skipped"][f"serving {where}"] = f"the time budget ({args.budget_s:.0f} s) left no room to compile"
                continue
            log(f"serving: preparing {where} ...")
            try:
                if measure == "decode":
                    runner = serving.DecodeStep(model, batch, args.context, compiled=mode == "compiled").capture()
                    timers[key] = functools.partial(runner.time_us, args.replays)
                else:
                    timers[key] = functools.partial(serving.Prefill(model, prefill_ids).capture().time_us,
                                                    PREFILL_REPLAYS)
            except Exception as e:  # noqa: BLE001 - one failing variant must not end the run
                payload["errors"].append({"where": f"serving {where}", "error": _err_text(e)})
                log(f"error: serving {where}: {_err_text(e)}")
    log(f"serving: {args.repeats} rounds of {len(timers)} measures ...")
    samples, errors, notes = serving.interleaved_rounds(timers, args.repeats, log, deadline)
    payload["serving"] = {"samples": samples, "results": serving.summarize(samples)}
    payload["errors"] += errors
    payload["notes"] += notes


def warm_up(mode, models, generate, args, payload, elapsed):
    """Warm every variant up in ``mode``; returns the variants ready to be timed.

    Compiled: the first call compiles (checked in Dynamo's counters). A variant that
    fails to compile as one graph is compiled again with graph breaks allowed, so it
    still gets a time (marked as such), after every other variant: a compile with many
    breaks can take long, and the budget goes to the others first."""
    ready = [name for name in models if _warm_up_one(mode, name, generate, args, payload, elapsed)]
    retry = [name for name in models if payload["compile"].get(f"{mode} {name}", {}).get("fullgraph_failed")]
    for name in retry:
        generate.allow_graph_breaks(name)
        if _warm_up_one(mode, name, generate, args, payload, elapsed):
            ready.append(name)
    return [name for name in models if name in ready]


def is_dynamo_error(e):
    """Whether ``e`` (or what caused it) is Dynamo's: a graph break under fullgraph=True
    raises one of torch._dynamo.exc's errors."""
    while e is not None:
        if type(e).__module__.startswith("torch._dynamo"):
            return True
        e = e.__cause__ or e.__context__
    return False


def _warm_up_one(mode, name, generate, args, payload, elapsed):
    """Three generate calls of one variant; True when it is ready to be timed."""
    key = f"{mode} {name}"
    if mode == "compiled" and not fits_budget(elapsed(), COMPILE_ESTIMATE_S, args.budget_s):
        payload["skipped"][key] = f"the time budget ({args.budget_s:.0f} s) left no room to compile"
        return False
    fullgraph = generate.fullgraph(name)
    log(f"{mode}: warming up {name}" + (" (fullgraph)" if fullgraph else "") + " ...")
    before, t0 = dynamo_counters(), time.perf_counter()
    error, graph_break = None, False
    try:
        # N first: in compiled mode it compiles and sizes the static cache for T(1) too
        for n in (args.new_tokens, 1, args.new_tokens):
            generate(name, n)
    except Exception as e:  # noqa: BLE001 - reported; the other variants go on
        error, graph_break = _err_text(e), is_dynamo_error(e)
    delta = counter_delta(before, dynamo_counters())
    payload["compile"][key] = {"warmup_s": time.perf_counter() - t0,
                               "fullgraph": fullgraph if mode == "compiled" else None,
                               "graphs": graph_count_of(delta), "counters": delta}
    if error:
        retry = fullgraph and graph_break
        where = f"{key} fullgraph compile" if retry else f"{key} warm-up"
        payload["errors"].append({"where": where, "error": error})
        log(f"error: {where}: {error}" + ("; compiling it again with graph breaks allowed, after the others"
                                           if retry else ""))
        payload["compile"][key]["fullgraph_failed"] = retry
        return False
    if mode == "compiled" and graph_count_of(delta) == 0:
        payload["errors"].append({"where": key, "error": "generate compiled nothing (transformers' "
                                  "auto-compile criteria not met?): not timed"})
        return False
    return True


def summarize_into(args, payload, elapsed):
    payload["results"] = summarize(payload["timings"], args.new_tokens, args.batch)
    payload["meta"]["seconds"] = elapsed()
