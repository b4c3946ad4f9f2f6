"""DTensor sharding of the registered torch ops (``torch.distributed.tensor``).

Every op normalizes each row (each head, for QK norm + RoPE) on its own, so an op runs on each
rank's shard unchanged when the arrays of x's shape are sharded on one axis but the last, or
replicated, the weights and tables replicated; a weight's gradient is then a partial sum over
the row shards (``Partial()``). Each family declares its ops' arguments by role in its
``_bind_torch`` (``shard_rows``); this module turns a declaration into a
``torch.distributed.tensor.experimental.register_sharding`` strategy.

``torch.distributed.tensor`` costs seconds to import, so nothing here imports it: declarations
wait until it is imported (now, if it was already), then register.
"""

import importlib.abc
import importlib.util
import sys

ROWS = "rows"          # an array of x's shape (q's and k's for QK norm + RoPE): sharded on any axis but the last
PARTIAL = "partial"    # a weight's gradient: the sum over the shards' rows (replicated when the rows are)
SCALES = "scales"      # quantized ops' per-token or per-group scales: with the rows; a given static scale replicated


def grad_of(name):
    """The role of the gradient of per-token table ``name``: placed as the table is where the table
    is split with the rows, else (broadcast over the split axis) the partial sum of the shards'."""
    return ("grad_of", name)

_DTENSOR = "torch.distributed.tensor"
_pending = []           # declarations not registered yet: torch.distributed.tensor not imported
_registered = set()     # the ops with a strategy


def shard_rows(op, rows, outputs, per_token=None, inner_axes=1):
    """Declare the sharding of ``op`` (a registered op: ``torch.ops.cupy_rmsnorm.<name>``).

    Args:
        op: the op (its default overload is registered).
        rows: the names of the tensor arguments of x's shape (sharded alike); the first fixes the axes.
        outputs: one role per output of the op's schema: ROWS, PARTIAL, SCALES or grad_of(table).
        per_token: {name: axes after its token axes} of tables that carry the token axes, broadcast
            against the rows' token axes (transformers' cos / sin: 1, vLLM's positions: 0). Every
            other tensor argument (weights, cos_sin_cache, a static scale) is replicated.
        inner_axes: the rows' axes after their token axes (1: hidden; 2: heads and head_dim).
    """
    overload = _overload(op)
    declaration = (overload, tuple(rows), tuple(outputs), dict(per_token or {}), inner_axes)
    if len(outputs) != len(overload._schema.returns):
        raise ValueError(f"outputs must give one role per output of {overload}: "
                         f"{len(overload._schema.returns)}, got {len(outputs)}")
    if _DTENSOR in sys.modules:
        _register(*declaration)
    else:
        _pending.append(declaration)
        _after_import(_DTENSOR, _register_pending)


def _overload(op):
    """The OpOverload of a custom op (torch.library.custom_op's result) or of torch.ops' packet."""
    import torch
    if isinstance(op, torch._ops.OpOverload):
        return op
    if isinstance(op, torch._ops.OpOverloadPacket):
        return op.default
    namespace, name = op._qualname.split("::")     # a CustomOpDef
    return getattr(getattr(torch.ops, namespace), name).default


def _register_pending():
    while _pending:
        _register(*_pending.pop(0))


def _register(op, rows, outputs, per_token, inner_axes):
    if op in _registered:       # a second bind: the first registration holds
        return
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.experimental import register_sharding

    schema = op._schema
    names = [a.name for a in schema.arguments]
    mutated = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]

    def row_placements(specs, row):
        """{argument name: placement} of the tensor arguments, the rows placed ``row``."""
        token_axes = specs[rows[0]].ndim - inner_axes
        placed = {}
        for name, spec in specs.items():
            if name in rows:
                placed[name] = row
            elif name in per_token and isinstance(row, Shard) and row.dim < token_axes:
                # the table's token axes end where the rows' do (NumPy's broadcasting)
                dim = row.dim - token_axes + spec.ndim - per_token[name]
                broadcast = dim < 0 or spec.shape[dim] == 1
                placed[name] = Replicate() if broadcast else Shard(dim)
            else:
                placed[name] = Replicate()
        return placed

    def output_placement(role, row, args, placed):
        if isinstance(role, tuple):         # grad_of(table)
            table = placed.get(role[1])
            if isinstance(table, Shard):
                return table
            return Partial() if isinstance(row, Shard) else Replicate()
        if role == PARTIAL:
            return Partial() if isinstance(row, Shard) else Replicate()
        if role == SCALES and args.get("scale") is not None:
            return Replicate()      # the static scale, not one per row
        return row

    def strategies(*args, **kwargs):
        # DTensor lists the inputs' placements positional arguments first, then keywords
        bound = dict(zip(names, args), **kwargs)
        specs = {name: v for name, v in bound.items() if hasattr(v, "placements")}
        anchor = specs[rows[0]]
        if mutated:
            choices = _in_place_choices(op, mutated, specs, anchor, row_placements)
        else:
            choices = [Replicate()] + [Shard(d) for d in range(anchor.ndim - 1)]
        result = []
        for row in choices:
            placed = row_placements(specs, row)
            result.append(([output_placement(role, row, bound, placed) for role in outputs],
                           [placed.get(name) for name in bound]))
        return result

    register_sharding(op)(strategies)
    _registered.add(op)


def _in_place_choices(op, mutated, specs, anchor, row_placements):
    """An in-place op's rows stay where they are (a redistributed input would take the write):
    its one strategy per mesh axis is the written arrays' own placements; ValueError, naming
    the argument, when they differ, are partial or shard the normalized axis."""
    from torch.distributed.tensor import Replicate, Shard
    written = specs[mutated[0]].placements
    for name in mutated:
        placements = specs[name].placements
        if placements != written:
            raise ValueError(f"{op} writes {' and '.join(mutated)} in place: {name} must have {mutated[0]}'s "
                             f"placements {written}, got {placements}")
        for p in placements:
            if not (isinstance(p, Replicate) or isinstance(p, Shard) and p.dim < anchor.ndim - 1):
                raise ValueError(f"{op} writes {name} in place, so it cannot be redistributed: its placements "
                                 f"must be Replicate() or Shard(d) on an axis but the last, got {placements}")
    choices = list(dict.fromkeys(written))
    if len(choices) > 1:
        # several mesh axes, placed differently: DTensor tries every mix of the choices and would
        # take a free one (a replicated array chunked) as readily as this one; no input may move
        wanted = [row_placements(specs, p) for p in written]
        for name, spec in specs.items():
            placements = tuple(w[name] for w in wanted)
            if spec.placements != placements:
                raise ValueError(f"{op} writes {' and '.join(mutated)} in place on a mesh of {len(written)} axes: "
                                 f"{name} must come placed {placements}, got {spec.placements}")
    return choices


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``then`` once the module ``name`` has been executed (a post-import hook)."""

    def __init__(self, name, then):
        self.name, self.then = name, then

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        original, then = spec.loader, self.then
        exec_module = original.exec_module

        class Loader(importlib.abc.Loader):
            def __getattr__(self, attr):        # anything else: the module's own loader's
                return getattr(original, attr)

            def create_module(self, module_spec):
                return original.create_module(module_spec)

            def exec_module(self, module):
                exec_module(module)
                then()

        spec.loader = Loader()
        return spec


def _after_import(name, then):
    if not any(isinstance(f, _AfterImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, then))
