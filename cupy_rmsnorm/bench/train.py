"""``train``: a small random HF Llama (bf16 parameters) trained with HF's norms and, from the same
weights, with ours (``patch_hf_rmsnorm``): both loss curves, their largest difference, median step times.
"""

import argparse
import copy
import functools
import statistics
import sys
import time

from . import common, report

SUMMARY = "a training check: a small Llama trained with HF's norms and with ours"
VARIANTS = ("hf", "ours")
WARMUP_STEPS = 5          # left out of the median step time (allocator, autotuning, compiles)
DEFAULTS = {"steps": 100, "layers": 4, "hidden": 1024, "batch": 8, "seq": 512}
QUICK = {"steps": 20, "layers": 2, "hidden": 512, "seq": 256}
NEEDS = f"torch with CUDA and transformers ({common.INSTALL_HINTS['transformers']})"


def add_arguments(p):
    common.add_common_options(p)
    p.add_argument("--steps", type=common.positive_int, help="AdamW steps (default: 100; --quick: 20)")
    p.add_argument("--layers", type=common.positive_int, help="decoder layers (default: 4; --quick: 2)")
    p.add_argument("--hidden", type=common.positive_int, help="hidden size, a multiple of 16 (default: 1024; "
                                                              "--quick: 512)")
    p.add_argument("--batch", type=common.positive_int, help="sequences per step (default: 8)")
    p.add_argument("--seq", type=common.positive_int, help="tokens per sequence (default: 512; --quick: 256)")
    p.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate")
    p.add_argument("--seed", type=int, default=0, help="weights and tokens")
    # "cpu": a tiny run to smoke the harness without a GPU
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help=argparse.SUPPRESS)


def finish_args(args, parser):
    common.resolve_defaults(args, DEFAULTS, QUICK)
    if args.hidden % 16:
        parser.error(f"--hidden {args.hidden} is not a multiple of the 16 attention heads")


requirements_missing = common.transformers_missing


# -- the report ----------------------------------------------------------------------------------
def _losses(payload):
    by = {r["variant"]: r for r in payload["results"]}
    return by, list(zip(by["hf"]["losses"], by["ours"]["losses"])) if len(by) == 2 else []


def _shown_steps(n):
    return sorted(set(range(0, n, 10)) | {n - 1}) if n else []


HEADERS = ["step", "hf loss", "ours loss", "|diff|"]


def table_rows(payload):
    _, pairs = _losses(payload)
    return [[str(i), f"{pairs[i][0]:.4f}", f"{pairs[i][1]:.4f}", f"{abs(pairs[i][0] - pairs[i][1]):.4f}"]
            for i in _shown_steps(len(pairs))]


def summary(payload):
    meta, (by, pairs) = payload["meta"], _losses(payload)
    c = meta.get("config", {})
    lines = [f"{meta.get('norms_replaced', '?')} norms replaced; {meta.get('params', '')}; {c.get('steps')} AdamW "
             f"steps, {c.get('layers')} layers x {c.get('hidden')}, batch {c.get('batch')} x {c.get('seq')}"]
    if pairs:
        lines.append(f"max |loss difference| {payload['max_abs_loss_diff']:.4g}; median step: hf "
                     f"{by['hf']['median_step_ms']:.1f} ms, ours {by['ours']['median_step_ms']:.1f} ms")
    return lines


def _report(payload, markdown=False):
    rows = table_rows(payload)
    sections = [("losses, every tenth step and the last", HEADERS, rows, (), None)] if rows else []
    return report.render_report(payload, "Training check", summary(payload), sections, markdown)


format_report, format_markdown = _report, functools.partial(_report, markdown=True)


def csv_records(payload):
    by, pairs = _losses(payload)
    return [{"step": i, "hf_loss": a, "ours_loss": b, "abs_diff": abs(a - b), "hf_step_ms": by["hf"]["step_s"][i] * 1e3,
             "ours_step_ms": by["ours"]["step_s"][i] * 1e3} for i, (a, b) in enumerate(pairs)]


def write_charts(payload, stem):
    """``stem.png``: both loss curves, and their difference."""
    from matplotlib.figure import Figure
    by, pairs = _losses(payload)
    if not pairs:
        return []
    fig = Figure(figsize=(9, 5.5), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(3, 1))
    for name in VARIANTS:
        top.plot(by[name]["losses"], label=f"{name} (median step {by[name]['median_step_ms']:.1f} ms)")
    bottom.plot([abs(a - b) for a, b in pairs], color="black")
    top.set_ylabel("loss")
    top.legend(fontsize=8)
    bottom.set_ylabel("|difference|")
    bottom.set_xlabel("step")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    fig.suptitle("training check: the same Llama with HF's norms and with ours (bf16 parameters)", fontsize=10)
    fig.savefig(stem + ".png", dpi=110)
    return [stem + ".png"]


# -- the run -----------------------------------------------------------------------------------------
def build_model(torch, args):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(args.seed)
    config = LlamaConfig(vocab_size=32000, hidden_size=args.hidden, intermediate_size=int(args.hidden * 2.75),
                         num_hidden_layers=args.layers, num_attention_heads=16, num_key_value_heads=4,
                         max_position_embeddings=args.seq, rms_norm_eps=1e-6, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).to(device=args.device, dtype=torch.bfloat16)
    with torch.no_grad():            # norm weights away from one, so their numerics matter
        for m in model.modules():
            if type(m).__name__ == "LlamaRMSNorm":
                m.weight.normal_(1.0, 0.1)
    return model.train()


def train(torch, model, batches, lr):
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sync = torch.cuda.synchronize if batches[0].is_cuda else (lambda: None)
    losses, times = [], []
    for ids in batches:
        sync()
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    return losses, times


def run(args):
    import torch
    started = time.perf_counter()
    config = {k: getattr(args, k) for k in ("steps", "layers", "hidden", "batch", "seq", "lr", "seed")}
    device = common.gpu_device() if args.device == "cuda" else {"gpu": "cpu"}
    payload = {"meta": common.run_metadata("train", device, config=config,
                                           params="bfloat16 (AdamW states bfloat16, no autocast)"),
               "results": [], "errors": [], "skipped": {}}
    hf = build_model(torch, args)
    models = [("hf", hf)]
    if args.device == "cuda":
        import cupy_rmsnorm.torch as rnt
        ours = copy.deepcopy(hf)
        payload["meta"]["norms_replaced"] = rnt.patch_hf_rmsnorm(ours)
        models.append(("ours", ours))
    else:
        payload["skipped"]["ours"] = "needs CUDA (--device cpu)"
    gen = torch.Generator(device=args.device).manual_seed(args.seed + 1)
    batches = [torch.randint(3, 32000, (args.batch, args.seq), generator=gen, device=args.device)
               for _ in range(args.steps)]
    interrupted = False
    try:
        for name, model in models:
            losses, times = train(torch, model, batches, args.lr)
            payload["results"].append({"variant": name, "losses": losses, "step_s": times,
                                       "median_step_ms": 1e3 * statistics.median(times[WARMUP_STEPS:] or times)})
            report.log(f"{name}: final loss {losses[-1]:.4f}, median step {payload['results'][-1]['median_step_ms']:.1f} ms")
    except KeyboardInterrupt:
        interrupted = True
        report.log("interrupted: saving what was measured")
    _, pairs = _losses(payload)
    payload["max_abs_loss_diff"] = max((abs(a - b) for a, b in pairs), default=None)
    payload["meta"]["seconds"] = time.perf_counter() - started
    return common.finish_run(sys.modules[__name__], args, payload, interrupted)
