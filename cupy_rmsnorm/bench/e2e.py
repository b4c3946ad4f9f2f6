"""``e2e``: a random Llama (``--model qwen3``: Qwen3) with HF's norms (``hf``), ours (``ours``,
``ours_fused``: residual adds fused, ``ours_qk``: q/k norm with the rotation, ``kernelized``: through
``cupy_rmsnorm.hf.kernelize``), transformers' Hub kernel for its norms (``hf_kernels``, Liger's) and
Liger's: a CUDA-graph decode step and a prefill, interleaved round by round; logits and each norm
checked against ``hf``.
"""

import argparse
import copy
import functools
import importlib
import importlib.metadata
import itertools
import os
import sys
import time
from typing import NamedTuple

from . import common, peers, report, serving

SUMMARY = "a whole Llama- or Qwen3-shaped model's decode step and prefill, with HF's, our and Liger's norms"

class Family(NamedTuple):
    """A transformers model family: its classes, Liger's patch, its MLP size at 4096 wide."""
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

VARIANTS = ("hf", "ours", "ours_fused", "ours_qk", "kernelized", "hf_kernels", "liger")
DESCRIPTIONS = VARIANT_TITLES = {
    "hf": "transformers' RMSNorm of the model, as built",
    "ours": "patch_hf_rmsnorm(model)",
    "ours_fused": "patch_hf_rmsnorm(model, fuse_residual=True)",
    "ours_qk": "patch_hf_rmsnorm(model, fuse_qk_rope=True) (Qwen3)",
    "kernelized": "cupy_rmsnorm.hf.kernelize(model, mode='inference') (kernels' kernelize, our mapping)",
    "hf_kernels": "kernels' kernelize with the RMSNorm entry of transformers' use_kernels mapping "
                  "(a Liger layer from the Hub; use_kernels also swaps rotary and SiLU)",
    "liger": "Liger-Kernel's RMSNorm only (apply_liger_kernel_to_*(rms_norm=True), no other patch)",
}
BASELINE = "hf"
OPT_IN = ("kernelized", "hf_kernels")   # run when named: the published runs predate them, hf_kernels fetches
EPS = 1e-6
VOCAB = 32000
AGREE_BATCH = 4              # sequences of --agree-tokens in the teacher-forced forward
NORM_WEIGHT_STD = 0.1        # norm weights 1 + N(0, 0.1): at all-ones, llama and fp32 rounding agree
PREFILL_REPLAYS = 3          # a 2048-token forward runs for milliseconds: a few calls per sample
COMPILE_ESTIMATE_S = 75.0    # one variant's compile, for the time budget (8-layer Llama on an H200)
DEFAULTS = {"layers": 8, "hidden": 4096, "heads": 32, "kv_heads": 8, "repeats": 5, "agree_tokens": 1024,
            "step_modes": list(serving.STEP_MODES), "step_batches": [1, 64], "prefill": 2048, "replays": 50}
QUICK = {"layers": 2, "repeats": 2, "agree_tokens": 256, "step_modes": ["eager"], "step_batches": [1],
         "prefill": 512, "replays": 10}


class Skipped(Exception):
    """This variant cannot run here (not installed, no such keyword, no CUDA): reported, not an error."""


NEEDS = (f"torch with CUDA and transformers ({common.INSTALL_HINTS['transformers']}); liger: "
         f"{common.INSTALL_HINTS['liger']}; kernelized, hf_kernels: pip install kernels (hf_kernels: and the Hub, "
         f"or --hf-kernels-repo)")


def add_arguments(p):
    common.add_common_options(p, repeats="interleaved rounds over the variants (--quick: 2)", charts=False)
    positive = common.positive_int
    p.add_argument("--model", choices=tuple(FAMILIES), default="llama",
                   help="the model's family (qwen3: per-head q/k norms, the ours_qk variant)")
    p.add_argument("--layers", type=positive, help="decoder layers (--quick: 2)")
    p.add_argument("--hidden", type=positive, help="hidden size")
    p.add_argument("--intermediate", type=positive, help="MLP intermediate size (default: Llama 14336, Qwen3 12288)")
    p.add_argument("--heads", type=positive, help="attention heads")
    p.add_argument("--kv-heads", type=positive, help="key/value heads")
    p.add_argument("--dtype", type=common.argparse_type(common.parse_dtype), default="bfloat16",
                   help="the model's dtype: bf16, fp16 or fp32")
    p.add_argument("--variants", type=common.comma_list(str.lower, VARIANTS, "variant"),
                   help=f"a list of {', '.join(VARIANTS)} (default: all the model has but {' and '.join(OPT_IN)}; "
                        "hf always runs, as the reference)")
    p.add_argument("--agree-tokens", type=positive,
                   help="tokens of the teacher-forced forward that checks the logits (--quick: 256)")
    p.add_argument("--step-modes", type=common.comma_list(str.lower, serving.STEP_MODES, "step mode"),
                   help="forms of the timed decode step: eager, compiled (--quick: eager)")
    p.add_argument("--step-batches", type=common.comma_list(common.positive_int, what="batch"),
                   help="sequences per decode step (--quick: 1)")
    p.add_argument("--context", type=positive, default=512, help="the decode step's position in its static cache")
    p.add_argument("--prefill", type=positive, help="tokens of the timed prefill (--quick: 512)")
    p.add_argument("--replays", type=positive, help="CUDA graph replays per timed decode step sample (--quick: 10)")
    p.add_argument("--budget-s", type=float, default=None, metavar="S",
                   help="start no compile and no round that would end past S seconds from the start")
    p.add_argument("--seed", type=int, default=0, help="weights and token ids")
    p.add_argument("--hf-kernels-repo", metavar="PATH",
                   help="hf_kernels: load the layer that transformers' RMSNorm entry names (its layer name and "
                        "modes kept) from this local kernel repository (a copy of the Hub one, as `hf download` "
                        "gives it) instead of the Hub; the report records the path")
    # "cpu": the hf variant alone, to smoke the harness without a GPU
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help=argparse.SUPPRESS)


def finish_args(args, p):
    common.resolve_defaults(args, DEFAULTS, QUICK)
    family = FAMILIES[args.model]
    if args.intermediate is None:
        args.intermediate = family.intermediate
    if args.variants is None:
        args.variants = [v for v in VARIANTS if v not in OPT_IN and (v != "ours_qk" or family.qk_norms)]
    if args.hidden % args.heads:
        p.error(f"--hidden {args.hidden} is not a multiple of --heads {args.heads}")
    if args.heads % args.kv_heads:
        p.error(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")
    if BASELINE not in args.variants:       # every comparison is against it
        args.variants = [BASELINE] + args.variants
    if args.hf_kernels_repo is not None:
        if "hf_kernels" not in args.variants:
            p.error("--hf-kernels-repo is for the hf_kernels variant: name it in --variants")
        if not os.path.isdir(args.hf_kernels_repo):
            p.error(f"--hf-kernels-repo {args.hf_kernels_repo}: not a directory")
        args.hf_kernels_repo = os.path.abspath(args.hf_kernels_repo)


requirements_missing = common.transformers_missing


def model_config(args):
    """The config keywords (LlamaConfig's, Qwen3Config's) of this run."""
    return {"vocab_size": VOCAB, "hidden_size": args.hidden, "intermediate_size": args.intermediate,
            "head_dim": args.hidden // args.heads, "num_hidden_layers": args.layers, "num_attention_heads": args.heads,
            "num_key_value_heads": args.kv_heads, "rms_norm_eps": EPS,
            "max_position_embeddings": max(2048, args.agree_tokens, args.context + 1, args.prefill),
            "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def fits_budget(elapsed_s, needed_s, budget_s):
    """Whether a step of about ``needed_s`` seconds still ends within the budget."""
    return budget_s is None or elapsed_s + needed_s <= budget_s


# -- the report ---------------------------------------------------------------------------------
def serving_records(payload):
    return [{"measure": r["measure"], "batch": r["batch"], "mode": r["mode"], "variant": r["variant"],
             "us": r["us"]["median"], "us_min": r["us"]["min"], "us_max": r["us"]["max"], "rounds": r["us"]["n"],
             "vs_hf": r["vs_hf"], "vs_hf_compiled": r["vs_hf_compiled"]}
            for r in (payload.get("serving") or {}).get("results") or []]


def _cell(value, spec=".3f"):
    return "-" if value is None else format(value, spec)


SERVING_HEADERS = ["measure", "batch", "mode", "variant", "us", "min-max", "vs hf (same mode)", "vs hf compiled"]
AGREEMENT_HEADERS = ["variant", "top-1 agree", "max abs dlogit", "logits differing", "norm outputs differing",
                     "norm max ulps", "top-1 vs fp32", "max abs vs fp32"]
AGREEMENT_KEYS = (("top1_agree", ".4f"), ("max_abs_diff", ".3g"), ("logits_differing", ".2%"),
                  ("norm_outputs_differing", ".4%"), ("norm_max_ulps", ".3g"), ("top1_vs_fp32", ".4f"),
                  ("max_abs_vs_fp32", ".3g"))


def serving_rows(records):
    return [[r["measure"], str(r["batch"]), r["mode"], r["variant"], report.fmt_us(r["us"]),
             "-" if r["us_min"] is None else f"{report.fmt_us(r['us_min'])}-{report.fmt_us(r['us_max'])}",
             _cell(r["vs_hf"]), _cell(r["vs_hf_compiled"])] for r in records]


def agreement_rows(payload):
    """Per variant (and the floor): its logits and its norm outputs against hf's."""
    found = dict(payload.get("agreement") or {}, **({"floor: hf, mean in float64": payload["agreement_floor"]}
                                                   if payload.get("agreement_floor") else {}))
    return [[name, *(_cell(a.get(k), spec) for k, spec in AGREEMENT_KEYS)] for name, a in found.items()]


def describe(meta):
    c = meta["config"]
    return (f"{FAMILIES[meta.get('model', 'llama')].title} {c['num_hidden_layers']} layers x {c['hidden_size']} "
            f"(intermediate {c['intermediate_size']}, {c['num_attention_heads']}/{c['num_key_value_heads']} heads, "
            f"vocab {c['vocab_size']}), {meta['dtype']}, {meta['repeats']} interleaved rounds")


def floor_line(payload):
    f = payload.get("agreement_floor")
    return f and (f"agreement floor (hf with its mean of squares in float64 vs hf): top-1 {f['top1_agree']:.4f}; "
                  f"hf's arithmetic reimplemented: max abs dlogit {f['reimplementation_max_abs_diff']:.3g}")


def _report(payload, markdown=False):
    meta, steps = payload["meta"], serving_records(payload)
    sections = []
    if steps:
        sections.append((f"GPU time of a decode step at context {meta['context']} (one CUDA graph replayed "
                         f"{meta['replays']} times a sample) and of a {meta['prefill']}-token prefill, microseconds",
                         SERVING_HEADERS, serving_rows(steps), (0, 2, 3), None))
    if payload.get("agreement"):
        sections.append(("agreement with hf on one teacher-forced forward: logits, and each norm on hf's own input",
                         AGREEMENT_HEADERS, agreement_rows(payload), (0,), floor_line(payload)))
    intro = [describe(meta), "medians and min-max over rounds; vs hf below 1: faster than with HF's norms"]
    replaced = {name: n for name, n in (meta.get("replaced_norms") or {}).items() if n}
    if replaced:
        intro.append("norm modules replaced: " + ", ".join(f"{name} {n}" for name, n in replaced.items())
                     + (f" (hf_kernels: {meta['hf_kernels_layer']})" if meta.get("hf_kernels_layer") else ""))
    return report.render_report(payload, "End to end", intro, sections, markdown) + (
        "" if sections else "\nnothing was measured")


def format_report(payload):
    return _report(payload)


def format_markdown(payload):
    return _report(payload, markdown=True) if serving_records(payload) else ""


csv_records = serving_records


# -- the model and its variants (torch from here on) ------------------------------------------------------
def build_model(args):
    """The random model in the run's dtype (as default dtype, as from_pretrained), norm weights randomized."""
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
    """A copy of the module tree sharing every parameter and buffer: patching it leaves ``model`` as is."""
    memo = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    return copy.deepcopy(model, memo)


def apply_liger_rms_norm(model, family):
    """Liger's RMSNorm on ``model``'s norm modules, nothing else; returns how many."""
    try:
        import liger_kernel.transformers as liger
        patch = getattr(liger, family.liger_patch)
    except Exception as e:  # noqa: BLE001 - not installed, or Triton missing
        raise Skipped(f"liger_kernel is not importable ({report.error_text(e)})") from None
    modeling = importlib.import_module(family.modeling)
    saved = getattr(modeling, family.norm)
    try:
        patch(rope=False, cross_entropy=False, fused_linear_cross_entropy=False, rms_norm=True, swiglu=False,
              model=model)
    finally:
        setattr(modeling, family.norm, saved)   # its class-level swap would reach models built later
    return sum(m._get_name() == "LigerRMSNorm" for m in model.modules())


def _kernels_for_transformers():
    """The ``kernels`` package, where transformers marks its modules for it; else Skipped, with why."""
    try:
        import kernels
    except ImportError as e:
        raise Skipped(f"the kernels package is not importable ({report.error_text(e)}; pip install kernels)") from None
    from transformers.utils import is_kernels_available
    if not is_kernels_available():     # then its use_kernel_forward_from_hub marks nothing
        import transformers
        raise Skipped(f"transformers {transformers.__version__} does not take kernels "
                      f"{importlib.metadata.version('kernels')} (it accepts kernels in a version window of its own)")
    return kernels


def kernelized_modules(model):
    """{module path: module} of the modules whose forward ``kernels.kernelize`` swapped (an instance
    forward other than their class's)."""
    return {path: m for path, m in model.named_modules()
            if getattr(m.__dict__.get("forward"), "__func__", type(m).forward) is not type(m).forward}


def kernelize_ours(model):
    """``cupy_rmsnorm.hf.kernelize(model, mode="inference")``; returns how many norm modules it swapped."""
    _kernels_for_transformers()
    from cupy_rmsnorm import hf
    hf.kernelize(model, mode="inference")
    ours = {layer.forward for layer in (hf.RMSNorm, hf.RMSNormGated, hf.RMSNormZeroCentered)}
    swapped = kernelized_modules(model)
    if any(m.forward.__func__ not in ours for m in swapped.values()):
        raise RuntimeError(f"kernelize swapped modules to layers not ours: {sorted(swapped)}")
    return len(swapped)


HF_KERNEL_LAYER = "RMSNorm"     # the entry of transformers' mapping that the hf_kernels variant takes


def hf_kernel_entry():
    """The RMSNorm entry of transformers' default kernel mapping (``use_kernels=True``'s)."""
    from transformers.integrations import hub_kernels
    entry = hub_kernels.get_kernel_mapping_transformers().get(HF_KERNEL_LAYER)
    if not entry:
        raise Skipped(f"transformers' kernel mapping has no {HF_KERNEL_LAYER} entry")
    return entry


def hf_kernel_repository(entry, device):
    """'repo_id layer_name (version)' of ``device``'s repository in one entry of transformers' mapping."""
    repos = entry.get(device)
    if repos is None:
        return f"no {device} repository"
    repo = next(iter(repos.values())) if isinstance(repos, dict) else repos
    fields = [getattr(repo, name, None) or getattr(repo, "_" + name, None) for name in ("repo_id", "layer_name")]
    version = getattr(repo, "_version", None) or getattr(repo, "version", None)
    return " ".join(str(f) for f in fields if f) + (f" (version {version})" if version else "") or repr(repo)


def hf_kernel_local_entry(entry, device, repo_path):
    """``entry`` (transformers' mapping's: device -> repository, or device -> {mode: repository}) for
    ``device`` alone, each repository replaced by a ``kernels.LocalLayerRepository`` of ``repo_path``
    with its layer name: the same layer and modes, loaded from a local copy instead of the Hub."""
    kernels = _kernels_for_transformers()
    from pathlib import Path
    repos = entry.get(device)
    if repos is None:
        raise Skipped(f"transformers' {HF_KERNEL_LAYER} entry has no {device} repository to take from {repo_path}")

    def local(repo):
        return kernels.LocalLayerRepository(repo_path=Path(repo_path), layer_name=repo.layer_name)
    return {device: {mode: local(repo) for mode, repo in repos.items()} if isinstance(repos, dict) else local(repos)}


def hf_kernel_source(device, repo_path=None):
    """What the hf_kernels variant loads, for the report: the repository of transformers' entry, or
    the local path that stands in for it."""
    hub = hf_kernel_repository(hf_kernel_entry(), device)
    return hub if repo_path is None else f"the local copy {repo_path}, in place of the Hub's {hub}"


def kernelize_hf_default(model, device, repo_path=None):
    """The model as ``from_pretrained(..., use_kernels=True)`` gives its norms: ``kernels.kernelize``
    in inference mode (an eval model's) with the RMSNorm entry of transformers' own mapping alone (the
    full mapping also swaps rotary_pos_emb and SiLU for Hub kernels: the variant compares norms). The
    layer is fetched from the Hub, or with ``repo_path`` loaded from that local kernel repository
    (same layer name and modes); where that fails (no network, no build for this torch) the variant
    is Skipped with the error. Returns how many modules it swapped (all of them HF norms)."""
    kernels = _kernels_for_transformers()
    from cupy_rmsnorm.hf import _unmapped_layers_quiet
    entry = hf_kernel_entry()
    where = hf_kernel_repository(entry, device)
    if repo_path is not None:
        entry = hf_kernel_local_entry(entry, device, repo_path)
        where = f"{where}, from the local copy {repo_path}"
    try:
        with kernels.use_kernel_mapping({HF_KERNEL_LAYER: entry}, inherit_mapping=False), _unmapped_layers_quiet():
            kernels.kernelize(model, mode=kernels.Mode.INFERENCE, device=device, use_fallback=True)
    except Exception as e:  # noqa: BLE001 - the Hub out of reach, no build of the kernel for this torch or GPU
        raise Skipped(f"transformers' {HF_KERNEL_LAYER} kernel ({where}) could not be loaded: "
                      f"{report.error_text(e)}") from None
    swapped = kernelized_modules(model)
    if not swapped:
        raise Skipped(f"kernels' kernelize swapped no module for transformers' {HF_KERNEL_LAYER} ({where})")
    others = sorted(path for path, m in swapped.items() if not is_hf_norm(m))
    if others:
        raise RuntimeError(f"transformers' {HF_KERNEL_LAYER} mapping swapped modules that are not norms: {others}")
    return len(swapped)


# the keywords of patch_hf_rmsnorm each of our variants passes
PATCH_KEYWORDS = {"ours": {}, "ours_fused": {"fuse_residual": True}, "ours_qk": {"fuse_qk_rope": True}}


def make_variant(name, base, device, family, hf_kernels_repo=None):
    """(model, number of norm modules replaced) of one variant (hf_kernels: from the local kernel
    repository ``hf_kernels_repo`` where given)."""
    if name == BASELINE:
        return base, 0
    if name == "ours_qk" and not family.qk_norms:
        raise Skipped(f"{family.title} has no per-head q_norm / k_norm to fuse with the rotation (--model qwen3)")
    if device != "cuda":
        raise Skipped(f"needs CUDA (--device {device})")
    model = shared_weight_copy(base)
    if name == "liger":
        replaced = apply_liger_rms_norm(model, family)
    elif name == "kernelized":
        replaced = kernelize_ours(model)
    elif name == "hf_kernels":
        replaced = kernelize_hf_default(model, device, hf_kernels_repo)
    else:
        from cupy_rmsnorm.torch import patch_hf_rmsnorm
        keywords = PATCH_KEYWORDS[name]
        try:
            replaced = patch_hf_rmsnorm(model, **keywords)
        except TypeError as e:
            if not any(k in str(e) for k in keywords):
                raise
            raise Skipped(f"this cupy_rmsnorm's patch_hf_rmsnorm has no {', '.join(keywords)} keyword "
                          f"({report.error_text(e)})") from None
        if name == "ours_qk" and not any(getattr(m, "_cupy_rmsnorm_qk_rope", None) for m in model.modules()):
            raise RuntimeError("fuse_qk_rope rewrote no attention module")
    if not replaced:
        raise RuntimeError("no norm module was replaced")
    return model, replaced


def token_ids(args, batch, length, offset):
    import torch
    gen = torch.Generator(device=args.device).manual_seed(args.seed + offset)
    return torch.randint(3, VOCAB, (batch, length), generator=gen, device=args.device)


def logits_of(model, ids):
    import torch
    with torch.inference_mode():
        return model(input_ids=ids, use_cache=False).logits.float()


def float32_logits(model, ids):
    """Logits of a float32 copy of ``model`` (dropped after): what every bfloat16 variant approximates."""
    return logits_of(copy.deepcopy(model).float(), ids)


def is_hf_norm(module):
    return type(module).__name__ in HF_NORMS


def norm_calls(model, ids):
    """[(module path, input, output)] of every HF RMSNorm call in one forward of ``model`` (hf)."""
    calls = []
    handles = [m.register_forward_hook(lambda _, args, out, path=path: calls.append((path, args[0], out)))
               for path, m in model.named_modules() if is_hf_norm(m)]
    try:
        logits_of(model, ids)
    finally:
        for h in handles:
            h.remove()
    return calls


def ulps(values, reference):
    """|values - reference| in units of the last place of ``reference`` (its smallest normal at least)."""
    import torch
    info = torch.finfo(reference.dtype)
    ref = reference.float()
    unit = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(info.tiny)))) * info.eps
    return (values.float() - ref).abs() / unit


def agreement(model, ids, reference, calls, exact=None):
    """``model``'s logits against hf's ``reference`` (and the float32 model's ``exact``), and its norm
    modules on hf's own inputs (so a difference is the norm's arithmetic, not its propagation):
    the fraction of output elements whose bits differ and the largest difference in ulps."""
    import torch
    logits = logits_of(model, ids)
    diff = (logits - reference).abs()
    found = {"max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean()),
             "logits_differing": float((logits != reference).float().mean()),
             "top1_agree": top1(logits, reference), "reference_max_abs_logit": float(reference.abs().max())}
    modules, differing, worst = dict(model.named_modules()), 0, 0.0
    with torch.inference_mode():
        for path, x, want in calls:
            got = modules[path](x)
            got = (got[0] if isinstance(got, tuple) else got).to(want.dtype)
            differing += int((got != want).sum())
            worst = max(worst, float(ulps(got, want).max()))
    total = sum(want.numel() for _, _, want in calls)
    return dict(found, norm_outputs_differing=differing / total if total else 0.0, norm_max_ulps=worst,
                **vs_float32(logits, exact))


def top1(logits, reference):
    return float((logits.argmax(-1) == reference.argmax(-1)).float().mean())


def vs_float32(logits, exact):
    return {} if exact is None else {"top1_vs_fp32": top1(logits, exact),
                                     "max_abs_vs_fp32": float((logits - exact).abs().max())}


def _hf_norm_with_mean_in(mean_dtype, module, hidden_states):
    """HF's RMSNorm forward, its mean of squares in ``mean_dtype`` (float32: HF's bits; float64: rounded once)."""
    import torch
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.to(mean_dtype).pow(2).mean(-1, keepdim=True).to(torch.float32)
    hidden_states = hidden_states * torch.rsqrt(variance + module.variance_epsilon)
    return module.weight * hidden_states.to(input_dtype)


def with_norm_mean_in(base, mean_dtype):
    """A weight-sharing copy of ``base`` whose HF RMSNorm modules take their mean in ``mean_dtype``."""
    model = shared_weight_copy(base)
    for m in filter(is_hf_norm, model.modules()):
        m.forward = functools.partial(_hf_norm_with_mean_in, mean_dtype, m)
    return model


def agreement_floor(base, ids, reference, calls, exact):
    """The check's floor: hf with its variance rounded once; and its float32 twin (0 when it is HF's arithmetic)."""
    import torch
    floor = agreement(with_norm_mean_in(base, torch.float64), ids, reference, calls, exact)
    same = logits_of(with_norm_mean_in(base, torch.float32), ids)
    return dict(floor, reimplementation_max_abs_diff=float((same - reference).abs().max()))


log = report.log


def run(args):
    import torch  # noqa: F401 - loaded before the metadata, which then records torch's CUDA version
    started = time.perf_counter()
    deadline = None if args.budget_s is None else started + args.budget_s

    def elapsed():
        return time.perf_counter() - started

    device = common.gpu_device() if args.device == "cuda" else {"gpu": "cpu"}
    meta = common.run_metadata(
        "e2e", device, torch_device=args.device, model=args.model, config=model_config(args), dtype=args.dtype,
        repeats=args.repeats, agree_tokens=args.agree_tokens, agree_batch=AGREE_BATCH,
        variants={v: VARIANT_TITLES[v] for v in args.variants}, step_modes=args.step_modes,
        step_batches=args.step_batches, context=args.context, prefill=args.prefill, replays=args.replays,
        norm_weights=f"1 + N(0, {NORM_WEIGHT_STD})", budget_s=args.budget_s,
        **({"hf_kernels_repo": args.hf_kernels_repo} if args.hf_kernels_repo else {}))
    payload = {"meta": meta, "skipped": {}, "errors": [], "notes": [], "agreement": {}}
    interrupted = False
    try:
        measure_all(args, payload, elapsed, deadline)
    except KeyboardInterrupt:
        interrupted = True
        log("interrupted: saving what was measured")
    meta["seconds"] = elapsed()
    return common.finish_run(sys.modules[__name__], args, payload, interrupted, measured=serving_records(payload))


def measure_all(args, payload, elapsed, deadline):
    """Model, variants, agreement, then the serving measures, all into ``payload``."""
    meta = payload["meta"]
    log(f"e2e on {meta['device']['gpu']}: building the model ...")
    base = build_model(args)
    meta["parameters"] = sum(p.numel() for p in base.parameters())
    meta["build_s"] = elapsed()

    family = FAMILIES[args.model]
    models, replaced = {}, {}
    for name in args.variants:
        try:
            models[name], replaced[name] = make_variant(name, base, args.device, family, args.hf_kernels_repo)
        except Skipped as e:
            payload["skipped"][name] = str(e)
            log(f"skipped: {name}: {e}")
        except Exception as e:  # noqa: BLE001 - one failing variant must not end the run
            common.record_error(payload, f"patch {name}", e)
    meta["replaced_norms"] = replaced
    if "hf_kernels" in models:
        meta["hf_kernels_layer"] = hf_kernel_source(args.device, args.hf_kernels_repo)
    check_agreement(args, payload, base, models)

    if "compiled" in args.step_modes:
        peers.lift_recompile_limits()       # the variants share code objects: one Dynamo cache entry each
    measure_serving(args, payload, models, elapsed, deadline)


def check_agreement(args, payload, base, models):
    """One teacher-forced forward per variant against hf's; a variant that fails it is not timed."""
    ids = token_ids(args, AGREE_BATCH, args.agree_tokens, offset=2)
    reference, calls, exact = logits_of(models[BASELINE], ids), norm_calls(models[BASELINE], ids), None
    if args.dtype != "float32":
        try:
            exact = float32_logits(base, ids)
            payload["agreement"][BASELINE] = vs_float32(reference, exact)
        except Exception as e:  # noqa: BLE001 - a float32 copy may not fit: the run goes on without it
            payload["notes"].append(f"no agreement with the float32 model: {report.error_text(e)}")
    for name in [n for n in models if n != BASELINE]:
        try:
            payload["agreement"][name] = agreement(models[name], ids, reference, calls, exact)
        except Exception as e:  # noqa: BLE001
            common.record_error(payload, f"agreement {name}", e)
            del models[name]
    try:
        payload["agreement_floor"] = agreement_floor(base, ids, reference, calls, exact)
    except Exception as e:  # noqa: BLE001 - the floor is context, not a variant
        common.record_error(payload, "agreement floor", e)
    if payload.get("agreement_floor", {}).get("logits_differing") == 0.0:
        payload["notes"].append(f"the agreement check is blind at this size: hf with its mean of squares in "
                                f"float64 gives hf's logits bit for bit over {AGREE_BATCH} x {args.agree_tokens} "
                                f"tokens; the norm outputs' bits (norm outputs differing) still tell variants apart")


def measure_serving(args, payload, models, elapsed, deadline):
    """Every variant's decode steps and prefill, captured one by one, then timed in interleaved rounds."""
    timers = {}
    prefill_ids = token_ids(args, 1, args.prefill, offset=4)
    for measure, mode, batch in serving.measures(args.step_modes, args.step_batches, args.prefill):
        for name, model in models.items():
            key = (measure, mode, batch, name)
            where = " ".join(map(str, key))
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
                common.record_error(payload, f"serving {where}", e)
    log(f"serving: {args.repeats} rounds of {len(timers)} measures ...")
    samples, errors, notes = serving.interleaved_rounds(timers, args.repeats, log, deadline)
    payload["serving"] = {"samples": samples, "results": serving.summarize(samples)}
    payload["errors"] += errors
    payload["notes"] += notes
