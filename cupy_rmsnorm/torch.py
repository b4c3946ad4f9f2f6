"""PyTorch modules on top of cupy_rmsnorm, and a drop-in patch for Hugging Face models.

    import cupy_rmsnorm.torch as rnt
    norm = rnt.RMSNorm(4096, eps=1e-6, casting_mode="llama", dtype=torch.bfloat16, device="cuda")
    with torch.inference_mode():
        y = norm(x)
    n = rnt.patch_hf_rmsnorm(model)        # swap a transformers model's RMSNorm modules
    # patch_hf_rmsnorm(model, fuse_qk_rope=True): Qwen3's q_norm, k_norm and RoPE as one op too

Importing this submodule imports torch (and registers the library's torch ops);
``import cupy_rmsnorm`` alone never does.

Under torch.compile (``fullgraph=True`` included) each norm is one registered op
(``torch.ops.cupy_rmsnorm.*``, registered by each family in ``cupy_rmsnorm.ops``): dynamo traces no
library Python, and CUDA graphs capture the launches. The modules train: with grad mode
on and a tensor that requires grad (the weight Parameter does), a call goes through the
registered op, whose backward is the library's backward kernels (gradients of x, the
residual and the weight; deterministic). Calls under ``torch.no_grad()`` /
``torch.inference_mode()`` (which ``model.generate`` uses) keep the thin direct path. The
in-place forms ``FusedAddRMSNorm(...)(x, residual, out=x, residual_out=residual)`` and
``qk_norm_rope(q, k, ..., out_q=q, out_k=k)`` are forward-only (a RuntimeError where autograd
would have to record them).
"""

import inspect
import sys
import warnings

import torch
from torch import nn

from ._interop import TorchKind
from ._validate import check_scalars
from .ops.forward import fused_add_rms_norm, rms_norm
from .ops.gated import rms_norm_gated
from .ops.gated.checks import check_gated
from .ops.layer_norm.module import LayerNorm, patch_layer_norms
from .ops.qk_rope import qk_norm_rope

TorchKind.bind()   # the library's torch ops, registered before anything is compiled

__all__ = ["RMSNorm", "FusedAddRMSNorm", "RMSNormGated", "LayerNorm", "patch_hf_rmsnorm"]


class _NormBase(nn.Module):
    """The weight and settings the two modules share."""

    def __init__(self, hidden_size, eps=1e-6, *, weight_offset=0.0, casting_mode="fp32",
                 dtype=None, device=None):
        super().__init__()
        self.eps, self.weight_offset, _ = check_scalars(eps, weight_offset, casting_mode, True)
        self.casting_mode = casting_mode
        self.hidden_size = int(hidden_size)
        self.weight = nn.Parameter(torch.empty(self.hidden_size, dtype=dtype, device=device))
        self.reset_parameters()

    def reset_parameters(self):
        # The effective scale is weight + weight_offset: start it at one (Gemma-style
        # weights, offset 1.0, start at zero).
        with torch.no_grad():
            self.weight.fill_(1.0 - self.weight_offset)

    @property
    def variance_epsilon(self):
        """``eps`` under the name Hugging Face's LlamaRMSNorm uses, for code that reads it."""
        return self.eps

    def extra_repr(self):
        s = f"{self.hidden_size}, eps={self.eps}, casting_mode={self.casting_mode!r}"
        return s + (f", weight_offset={self.weight_offset}" if self.weight_offset else "")


class RMSNorm(_NormBase):
    """``y = x / sqrt(mean(x**2, -1) + eps) * (weight + weight_offset)`` over the last axis.

    Args:
        hidden_size: size of the last axis.
        eps: added to the mean of squares.
        weight_offset: added to the weight in float32 (1.0 for Gemma-style weights).
        casting_mode: ``"fp32"`` (one rounding, as torch.nn.functional.rms_norm) or
            ``"llama"`` (rounds to x's dtype before the weight multiply, as HF LlamaRMSNorm).
        dtype, device: of the weight. The weight may be x's dtype or float32.

    ``forward(x)`` returns a new tensor of x's shape, dtype and device.
    ``add_and_norm(x, residual)`` returns ``(forward(x + residual), x + residual)`` in one
    kernel (the sum rounded to x's dtype first, as the unfused pair computes it).
    """

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps, weight_offset=self.weight_offset,
                        casting_mode=self.casting_mode)

    def add_and_norm(self, x, residual):
        return fused_add_rms_norm(x, residual, self.weight, self.eps, weight_offset=self.weight_offset,
                                  casting_mode=self.casting_mode)


class RMSNormGated(_NormBase):
    """Gated RMSNorm over the last axis (Gated DeltaNet, Mamba2, Nemotron-H):
    ``forward(x, gate)`` is ``rms_norm_gated(x, gate, weight, ...)``:
    ``rmsnorm(x) * (weight + weight_offset) * act(gate)`` (``norm_before_gate=True``) or
    ``rmsnorm(x * act(gate)) * (weight + weight_offset)``, each group of ``group_size``
    channels normalized on its own.

    Args:
        hidden_size, eps, weight_offset, casting_mode, dtype, device: as in ``RMSNorm``
            (``"llama"`` reproduces Hugging Face's gated modules' roundings).
        group_size: channels normalized together (None: the whole row).
        norm_before_gate: see above.
        activation: ``"silu"`` or ``"sigmoid"``.

    Trainable: gradients of x, the gate and the weight (the library's backward kernels).
    """

    def __init__(self, hidden_size, eps=1e-6, *, group_size=None, norm_before_gate=True, activation="silu",
                 weight_offset=0.0, casting_mode="fp32", dtype=None, device=None):
        super().__init__(hidden_size, eps, weight_offset=weight_offset, casting_mode=casting_mode, dtype=dtype,
                         device=device)
        spec = check_gated(group_size, norm_before_gate, activation)
        if spec.group_size is not None and self.hidden_size % spec.group_size:
            raise ValueError(f"group_size={spec.group_size} must divide hidden_size={self.hidden_size}")
        self.group_size, self.norm_before_gate, self.activation = spec.group_size, spec.norm_before_gate, spec.activation

    def forward(self, x, gate):
        return rms_norm_gated(x, gate, self.weight, self.eps, group_size=self.group_size,
                              norm_before_gate=self.norm_before_gate, activation=self.activation,
                              weight_offset=self.weight_offset, casting_mode=self.casting_mode)

    def extra_repr(self):
        return (super().extra_repr() + f", group_size={self.group_size}, norm_before_gate={self.norm_before_gate}, "
                f"activation={self.activation!r}")


class FusedAddRMSNorm(_NormBase):
    """Residual add then RMSNorm in one kernel: ``s = x + residual; (rms_norm(s), s)``.

    Same arguments as ``RMSNorm``. ``forward(x, residual)`` returns ``(out, residual_out)``;
    ``forward(x, residual, out=x, residual_out=residual)`` works in place (vLLM-style,
    nothing allocated).
    """

    def forward(self, x, residual, out=None, residual_out=None):
        return fused_add_rms_norm(x, residual, self.weight, self.eps, out=out, residual_out=residual_out,
                                  weight_offset=self.weight_offset, casting_mode=self.casting_mode)


# -- Hugging Face patch --------------------------------------------------------------------

# The numerics a replaced module can get, in order of preference when several match
# equally (with all-one weights "llama" and "fp32" give the same bits):
#   ("llama", 0.0): weight * round(x * inv_rms)        LlamaRMSNorm, Qwen2/3, Mistral, ...
#   ("fp32", 0.0):  round(weight * x * inv_rms)        e.g. OLMo-2-style norms
#   ("fp32", 1.0):  round((1 + weight) * x * inv_rms)  Gemma 1-3, Qwen3-Next/3.5-style norms
_CANDIDATES = (("llama", 0.0), ("fp32", 0.0), ("fp32", 1.0))
_PROBE_ROWS = 8
# Agreement needed with the original module on the probe: about two units in the last
# place; a wrong weight offset is off by the weight itself, far more.
_PROBE_TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _eps_of(module):
    for attr in ("variance_epsilon", "eps"):
        value = getattr(module, attr, None)
        if value is None:
            continue
        try:
            return float(value)
        except (TypeError, ValueError, RuntimeError):
            return None
    return None


def _candidates(model):
    """(name, module, weight, eps, gated) of every HF-style RMSNorm (class name ending in
    ``RMSNorm``) and gated RMSNorm (``RMSNormGated``) not yet replaced."""
    found = []
    for name, module in model.named_modules():
        kind = type(module).__name__
        gated = kind.endswith("RMSNormGated")
        if not name or isinstance(module, _NormBase) or not (gated or kind.endswith("RMSNorm")):
            continue
        weight = module._parameters.get("weight")
        eps = _eps_of(module)
        if isinstance(weight, nn.Parameter) and weight.dim() == 1 and eps is not None:
            found.append((name, module, weight, eps, gated))
    return found


def _group_size_of(module, hidden):
    """A gated module's ``group_size`` attribute when it splits the row, else None."""
    g = getattr(module, "group_size", None)
    return int(g) if isinstance(g, int) and 0 < g < hidden and hidden % g == 0 else None


@torch.no_grad()
def _matching_numerics(module, weight, eps, gated, forward=None):
    """The keyword arguments of this library's module that reproduce ``module`` on a probe
    input (casting_mode and weight_offset; for a gated module also norm_before_gate, and its
    group_size and activation as it states them), or None.

    Runs the original forward (``forward``, default ``module.forward``; cupy_rmsnorm.hf passes
    the class's own, since kernels replaced the instance's) and each candidate on the same
    random rows (a private generator: the caller's random state is left alone); among the
    candidates within tolerance, the one with the most bit-identical elements wins.
    """
    tol = _PROBE_TOLERANCE.get(weight.dtype)
    if tol is None:
        return None
    gen = torch.Generator(device=weight.device).manual_seed(0)
    hidden = weight.shape[0]
    x, gate = (torch.randn(_PROBE_ROWS, hidden, generator=gen, device=weight.device, dtype=torch.float32
                           ).to(weight.dtype) for _ in range(2))
    forward = module.forward if forward is None else forward
    try:   # forward itself: hooks on the module stay quiet
        expected = forward(x, gate) if gated else forward(x)
    except Exception:  # noqa: BLE001 - a forward that needs other arguments is not ours to replace
        return None
    if not isinstance(expected, torch.Tensor) or expected.shape != x.shape:
        return None
    expected = expected.float()
    candidates = [dict(casting_mode=mode, weight_offset=offset) for mode, offset in _CANDIDATES]
    if gated:
        activation = getattr(module, "activation", "silu")
        activation = {"swish": "silu"}.get(activation, activation)
        if activation not in ("silu", "sigmoid"):
            return None
        fixed = dict(group_size=_group_size_of(module, hidden), activation=activation)
        candidates = [dict(c, norm_before_gate=order, **fixed) for order in (True, False) for c in candidates]
    best = None
    for kwargs in candidates:
        if gated:
            got = rms_norm_gated(x, gate, weight, eps, **kwargs).float()
        else:
            got = rms_norm(x, weight, eps, **kwargs).float()
        if not torch.allclose(got, expected, rtol=tol, atol=tol):
            continue
        exact = int((got == expected).sum())
        if best is None or exact > best[0]:
            best = (exact, kwargs)
    return None if best is None else best[1]


# -- residual add + norm inside a decoder layer -------------------------------------------------

# The decoder layers fuse_residual rewrites: exactly these children (Llama, Mistral, Qwen2/3
# and other models generated from Llama's layer), and a forward of Llama's arguments.
_LAYER_CHILDREN = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
_LAYER_ARGUMENTS = {"self", "hidden_states", "attention_mask", "position_ids", "past_key_values", "cache",
                    "use_cache", "cache_position", "position_embeddings", "kwargs"}


def _fusable_layer(module):
    if {name for name, _ in module.named_children()} != _LAYER_CHILDREN:
        return False
    if not all(isinstance(getattr(module, n), RMSNorm) for n in ("input_layernorm", "post_attention_layernorm")):
        return False
    try:
        params = inspect.signature(type(module).forward).parameters
    except (TypeError, ValueError):
        return False
    return next(iter(params), None) == "self" and "hidden_states" in params and set(params) <= _LAYER_ARGUMENTS


def _fused_residual_forward(self, hidden_states, **kwargs):
    """A Llama decoder layer with both residual adds fused into the norm that follows them:
    the attention add into this layer's post-attention norm, the MLP add into the next norm
    (the next layer's input norm, or the model's final norm), whose result is handed over
    (see ``_take_handoff``). The layer's input is left untouched (HF may keep it as a
    recorded hidden state), so the ops are the out-of-place forms, and the layer still
    returns its own output, ``residual + mlp``. Layers trained with gradient checkpointing
    keep the MLP add to themselves."""
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(hidden_states=hidden_states, **kwargs)
    hidden_states, residual = self.post_attention_layernorm.add_and_norm(hidden_states, residual)
    hidden_states = self.mlp(hidden_states)
    following = self._cupy_rmsnorm_next[0]
    # Under gradient checkpointing the next layer's forward runs again in the backward, with
    # no handover: its recomputation would not match its first run, which checkpoint refuses.
    if following is None or (getattr(self, "gradient_checkpointing", False) and self.training):
        return residual + hidden_states
    normed, summed = following.add_and_norm(hidden_states, residual)
    following._cupy_rmsnorm_handoff[0] = (summed, normed)
    return summed


def _take_handoff(self, x):
    """The forward of a norm that a decoder layer feeds: when x is the very tensor that layer
    returned, its normalized form was computed with the add (same bits) and is taken as it is;
    any other input (a hook replaced the layer's output, the layers ran in another order) is
    normalized here. The slot is emptied when read."""
    slot = self._cupy_rmsnorm_handoff
    handed = slot[0]
    if handed is not None:
        slot[0] = None
        if handed[0] is x:
            return handed[1]
    return RMSNorm.forward(self, x)


def _decoder_stacks(model):
    """(layers, final norm or None) of each ModuleList of fusable decoder layers, in the
    order they run; the final norm is the list's sibling ``norm`` (LlamaModel.norm)."""
    stacks = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, nn.ModuleList) and len(child) and all(_fusable_layer(m) for m in child):
                norm = getattr(parent, "norm", None) if name == "layers" else None
                stacks.append((list(child), norm if isinstance(norm, RMSNorm) else None))
    return stacks


def _feed(layer, norm):
    """Let ``layer`` compute ``norm``'s input with its MLP residual add, in one kernel. (The
    norm is kept in a tuple: a module attribute would become a submodule, and a second
    state_dict entry of its weight.)"""
    layer._cupy_rmsnorm_next = (norm,)
    if "_cupy_rmsnorm_handoff" not in vars(norm):
        norm._cupy_rmsnorm_handoff = [None]
        norm.forward = _take_handoff.__get__(norm)


def _fuse_residuals(model):
    """Rewrite the forward of every fusable decoder layer (an instance attribute, so the
    class and other models are untouched), and chain each layer of a stack to the norm
    that follows it; returns how many layers were rewritten."""
    count = 0
    for module in model.modules():
        if getattr(module, "_cupy_rmsnorm_fused", False) or not _fusable_layer(module):
            continue
        module.forward = _fused_residual_forward.__get__(module)
        module._cupy_rmsnorm_fused = True
        module._cupy_rmsnorm_next = (None,)
        count += 1
    for layers, final_norm in _decoder_stacks(model):
        following = [layer.input_layernorm for layer in layers[1:]] + [final_norm]
        for layer, norm in zip(layers, following):
            if norm is not None:
                _feed(layer, norm)
    return count


# -- q_norm, k_norm and the rotation inside an attention module ------------------------------------

# The attention modules fuse_qk_rope rewrites: Qwen3's and Qwen3-MoE's in transformers, and any of
# the same structure. Its forward must contain these statements (compared without whitespace):
# the rewrite replaces the first four by one qk_norm_rope and keeps the rest as transformers
# writes it, so a forward written otherwise is not ours to rewrite.
_ATTENTION_CHILDREN = {"q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"}
_ATTENTION_ARGUMENTS = {"self", "hidden_states", "position_embeddings", "attention_mask", "cache", "past_key_values",
                        "kwargs"}
_ATTENTION_STATEMENTS = (
    "hidden_shape=(*input_shape,-1,self.head_dim)",
    "query_states=self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1,2)",
    "key_states=self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1,2)",
    "cos,sin=position_embeddings",
    "query_states,key_states=apply_rotary_pos_emb(query_states,key_states,cos,sin)",
    "value_states=self.v_proj(hidden_states).view(hidden_shape).transpose(1,2)",
    "attention_interface:Callable=ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,"
    "eager_attention_forward)",
    "attn_output=attn_output.reshape(*input_shape,-1).contiguous()",
    "attn_output=self.o_proj(attn_output)",
)
# The cache update, one of transformers' two forms (5.24 on: the cache takes the call's keyword
# arguments; before: the cache alone), and whether the form passes the keyword arguments
_CACHE_UPDATES = {
    "key_states,value_states=cache.update(key_states,value_states,self.layer_idx,kwargs=kwargs)": True,
    "key_states,value_states=past_key_values.update(key_states,value_states,self.layer_idx)": False,
}
# transformers' rotate_half: the NeoX halves, which qk_norm_rope turns with is_neox=True
_ROTATE_HALF = "returntorch.cat((-x2,x1),dim=-1)"


def _squeezed_source(obj):
    """The source of ``obj`` without whitespace and comments, or None where it cannot be read."""
    try:
        lines = inspect.getsource(obj).splitlines()
    except (OSError, TypeError):
        return None
    return "".join("".join(line.split("#", 1)[0].split()) for line in lines)


def _looks_like_qk_norm_attention(module):
    names = {name for name, _ in module.named_children()}
    return {"q_norm", "k_norm", "q_proj", "k_proj"} <= names


def _qk_rope_rewrite(module):
    """What the rewritten forward of ``module`` needs, (ALL_ATTENTION_FUNCTIONS,
    eager_attention_forward, whether sliding_window is passed, whether the cache update takes the
    keyword arguments), when it is an attention module
    of Qwen3's structure with both norms replaced by matching RMSNorm modules; else the reason
    it is not (a string)."""
    if not _ATTENTION_CHILDREN <= {name for name, _ in module.named_children()}:
        return f"it lacks some of {', '.join(sorted(_ATTENTION_CHILDREN))}"
    q_norm, k_norm = module.q_norm, module.k_norm
    if type(q_norm) is not RMSNorm or type(k_norm) is not RMSNorm:
        return "its q_norm and k_norm are not both cupy_rmsnorm RMSNorm modules (replaced by patch_hf_rmsnorm)"
    head_dim = getattr(module, "head_dim", None)
    if not isinstance(head_dim, int) or q_norm.hidden_size != head_dim or k_norm.hidden_size != head_dim:
        return "its q_norm and k_norm do not normalize head_dim channels"
    if ((q_norm.eps, q_norm.weight_offset, q_norm.casting_mode, q_norm.weight.dtype)
            != (k_norm.eps, k_norm.weight_offset, k_norm.casting_mode, k_norm.weight.dtype)):
        return "its q_norm and k_norm differ in eps, weight offset, casting mode or weight dtype"
    try:
        params = inspect.signature(type(module).forward).parameters
    except (TypeError, ValueError):
        return "its forward's signature cannot be read"
    if (list(params)[:3] != ["self", "hidden_states", "position_embeddings"]
            or not set(params) <= _ATTENTION_ARGUMENTS):
        return f"its forward takes ({', '.join(params)}), not Qwen3's arguments"
    source = _squeezed_source(type(module).forward)
    if source is None:
        return "its forward's source cannot be read"
    missing = [s for s in _ATTENTION_STATEMENTS if s not in source]
    if missing:
        return f"its forward is not written as Qwen3's (no {missing[0]!r})"
    updates = [passes for update, passes in _CACHE_UPDATES.items() if update in source]
    if not updates:
        return f"its forward is not written as Qwen3's (no {next(iter(_CACHE_UPDATES))!r})"
    defining = sys.modules.get(type(module).__module__)
    interfaces = getattr(defining, "ALL_ATTENTION_FUNCTIONS", None)
    eager = getattr(defining, "eager_attention_forward", None)
    rotate = _squeezed_source(getattr(defining, "rotate_half", None))
    if interfaces is None or eager is None or rotate is None or _ROTATE_HALF not in rotate:
        return (f"its module {type(module).__module__} lacks ALL_ATTENTION_FUNCTIONS, eager_attention_forward or "
                f"a rotate_half of NeoX halves")
    return interfaces, eager, "sliding_window=self.sliding_window" in source, updates[0]


def _fused_qk_rope_forward(self, hidden_states, position_embeddings, attention_mask=None, cache=None, **kwargs):
    """transformers' Qwen3 attention forward with q_norm, k_norm and the rotation of q and k as one
    ``qk_norm_rope`` (one rounding, after the rotation), the rest as transformers writes it."""
    if cache is None:     # the name transformers' own forward still accepts
        cache = kwargs.pop("past_key_values", None)
    interfaces, eager_attention, sliding, update_takes_kwargs = self._cupy_rmsnorm_qk_rope
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    cos, sin = position_embeddings
    q_norm, k_norm = self.q_norm, self.k_norm
    query_states, key_states = qk_norm_rope(
        self.q_proj(hidden_states).view(hidden_shape), self.k_proj(hidden_states).view(hidden_shape), q_norm.weight,
        k_norm.weight, q_norm.eps, cos=cos, sin=sin, weight_offset=q_norm.weight_offset,
        casting_mode=q_norm.casting_mode)
    query_states, key_states = query_states.transpose(1, 2), key_states.transpose(1, 2)
    value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

    if cache is not None and update_takes_kwargs:
        key_states, value_states = cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)
    elif cache is not None:
        key_states, value_states = cache.update(key_states, value_states, self.layer_idx)

    attention_interface = interfaces.get_interface(self.config._attn_implementation, eager_attention)
    if sliding:
        kwargs["sliding_window"] = self.sliding_window
    attn_output, attn_weights = attention_interface(
        self,
        query_states,
        key_states,
        value_states,
        attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling,
        **kwargs,
    )
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    attn_output = self.o_proj(attn_output)
    return attn_output, attn_weights


def _fuse_qk_rope(model):
    """Rewrite the forward of every attention module of Qwen3's structure (an instance attribute,
    so the class and other models are untouched); one that has q_norm and k_norm but another
    structure is left as it is, with a warning. Returns how many modules were rewritten."""
    count = 0
    for name, module in model.named_modules():
        if getattr(module, "_cupy_rmsnorm_qk_rope", None) is not None or not _looks_like_qk_norm_attention(module):
            continue
        rewrite = _qk_rope_rewrite(module)
        if isinstance(rewrite, str):
            warnings.warn(f"patch_hf_rmsnorm: left {name} ({type(module).__name__}) as it is: fuse_qk_rope "
                          f"rewrites attention modules of Qwen3's structure, and {rewrite}", stacklevel=3)
            continue
        module._cupy_rmsnorm_qk_rope = rewrite
        module.forward = _fused_qk_rope_forward.__get__(module)
        count += 1
    return count


def patch_hf_rmsnorm(model, fuse_residual=False, fuse_qk_rope=False, layer_norm=False):
    """Swap the RMSNorm modules of a transformers model for this library's ``RMSNorm``, and its
    gated RMSNorm modules for ``RMSNormGated``.

    A module is a candidate when its class name ends in ``RMSNorm`` (LlamaRMSNorm,
    Qwen2RMSNorm, Qwen3RMSNorm, MistralRMSNorm, GemmaRMSNorm, ...) or ``RMSNormGated``
    (Qwen3NextRMSNormGated, MambaRMSNormGated, NemotronHRMSNormGated, ...: ``forward(x,
    gate)``, a ``group_size`` and an ``activation`` attribute taken as they are) and it has a
    1-D ``weight`` parameter and a ``variance_epsilon`` or ``eps`` number. Each candidate
    is run once on a small random input and replaced only by the numerics that
    reproduce it: ``casting_mode="llama"`` for Llama-style forwards (they round to the
    input dtype before the weight multiply), ``"fp32"`` for a single final rounding, and
    ``weight_offset=1.0`` with ``"fp32"`` for Gemma-style ``(1 + weight)`` forwards; for a
    gated module also the order of norm and gate. A candidate that matches none (another
    formula, a forward that needs more arguments) is left as it is, with a warning.

    The new module shares the old one's weight Parameter (same object, same
    state_dict key), so loading, saving and tied weights are unaffected. On CUDA tensors the
    norms run the library's kernels; on CPU tensors its NumPy reference (the same bits as the
    kernels' contract, slower than torch's own norms: for tests and checks). Forward hooks on
    the old modules are not carried over.

    Differences from the original modules: the output has the input's dtype even when
    the weight's dtype differs (HF returns the promoted dtype there); the gradients are the
    library's backward (dx in float32 arithmetic, rounded once; HF's autograd rounds
    ``dy * weight`` to the dtype first in llama mode). Under torch.compile each is one registered
    op, so inductor no longer fuses the residual add before a norm into its own norm
    kernel: ``fuse_residual=True`` does that fusion here instead.

    fuse_residual: also rewrite each Llama-style decoder layer (children ``self_attn``,
        ``mlp``, ``input_layernorm``, ``post_attention_layernorm``, both norms replaced) so
        that each residual add runs inside the norm that follows it, as vLLM's model code
        does: the attention add with the post-attention norm, and the MLP add with the next
        layer's input norm (the model's final norm after the last layer) as one
        ``fused_add_rms_norm`` kernel. The layer still returns its output (the sum), and the
        next norm takes the normalized sum computed with it when its input is that very
        tensor (it normalizes any other input itself; under gradient checkpointing, while
        training, a layer keeps its MLP add, which the recomputation needs). Results are the
        same bits (the fused op rounds the sum to the dtype before normalizing, as the pair
        does). Other layer types are left as they are.
    fuse_qk_rope: also rewrite each attention module of Qwen3's structure (transformers'
        Qwen3Attention, Qwen3MoeAttention, and any module with ``q_proj``, ``k_proj``,
        ``v_proj``, ``o_proj``, ``q_norm``, ``k_norm``, an int ``head_dim`` and a forward
        written as theirs: ``position_embeddings=(cos, sin)``, ``apply_rotary_pos_emb(q, k,
        cos, sin)`` with transformers' NeoX ``rotate_half``) so that q_norm, k_norm and the
        rotation of q and k run as one ``qk_norm_rope`` kernel, as vLLM's Qwen3 does. The
        forward is an instance attribute (the class and other models are untouched) and keeps
        the rest as transformers writes it: the cache update with its keyword arguments, the
        attention interface of ``config._attn_implementation``, eager, torch.compile
        (``fullgraph=True``) and the static cache alike; it trains (dq_weight and dk_weight
        through the op's backward). Both norms must have been replaced (same eps, casting
        mode, weight offset and weight dtype). Another module with ``q_norm`` and ``k_norm``
        is left as it is, with a warning. Numerics: HF rounds the norm's output to the dtype
        (llama mode: the normalized value, then its product with the weight), and each
        product and sum of the rotation; the fused op rounds once, after the rotation, so in
        bfloat16 about a quarter of q's and k's elements differ from HF's by a few units
        (the logits stay within bfloat16's own distance from float32; see
        docs/numerics.md).
    layer_norm: also swap the model's ``torch.nn.LayerNorm`` modules over one trailing axis
        (vision towers, audio encoders) for ``LayerNorm``, sharing their Parameters (counted).

    Returns:
        The number of modules replaced (0 when the model is already patched); decoder
        layers rewritten by ``fuse_residual`` and attention modules rewritten by
        ``fuse_qk_rope`` are not counted.
    """
    found = _candidates(model)
    replacements = {}
    for name, module, weight, eps, gated in found:
        if id(module) in replacements:
            continue
        numerics = _matching_numerics(module, weight, eps, gated)
        if numerics is None:
            warnings.warn(f"patch_hf_rmsnorm: left {name} ({type(module).__name__}) as it is: its "
                          f"forward matches none of cupy_rmsnorm's formulas", stacklevel=2)
            continue
        new = (RMSNormGated if gated else RMSNorm)(weight.shape[0], eps, dtype=weight.dtype, device="meta",
                                                   **numerics)
        new.weight = weight        # the very same Parameter: no copy, same state_dict entry
        new.train(module.training)
        replacements[id(module)] = new
    # Every path to a replaced module, a module shared by two parents included.
    for name, module in list(model.named_modules(remove_duplicate=False)):
        new = replacements.get(id(module))
        if new is not None and name:
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    if fuse_residual:
        _fuse_residuals(model)
    if fuse_qk_rope:
        _fuse_qk_rope(model)
    return len(replacements) + (patch_layer_norms(model) if layer_norm else 0)
