"""The e2e report's serving measures: a decode step at position ``context`` of a static KV cache,
captured in a CUDA graph (the cache position reset captured with it, so every replay does the same
work), and an eager prefill; each in eager or compiled form, the variants interleaved round by round.
On a CPU (the smoke test) there is no graph and the host clock times. The transformers API in use
(cache keyword, ``cache_position``, StaticCache's keywords) is read from signatures.
"""

import inspect

from . import report

STEP_MODES = ("eager", "compiled")
WARMUP = 3                 # calls before capture: compiles, cuBLAS workspaces, lazy cache allocation


def takes(fn, name):
    return name in inspect.signature(fn).parameters


def cache_keyword(model):
    """The keyword under which ``model.forward`` takes its KV cache."""
    for name in ("cache", "past_key_values"):
        if takes(model.forward, name):
            return name
    raise RuntimeError("this transformers' forward takes neither `cache` nor `past_key_values`")


def static_cache(model, batch, length):
    """A StaticCache of ``length`` positions for ``batch`` sequences (the keywords this version takes)."""
    from transformers import StaticCache
    kwargs = {"config": model.config, "max_cache_len": length}
    optional = {"max_batch_size": batch, "batch_size": batch, "device": model.device, "dtype": model.dtype}
    kwargs.update({k: v for k, v in optional.items() if takes(StaticCache.__init__, k)})
    return StaticCache(**kwargs)


def rewind(cache, position):
    """Set a device-side write position (a tensor per layer) back to ``position``, where the cache has one."""
    import torch
    for layer in getattr(cache, "layers", ()):
        length = getattr(layer, "cumulative_length", None)
        if isinstance(length, torch.Tensor):
            length.fill_(position)


class DecodeStep:
    """One decode step as a callable; ``capture()`` records it in a CUDA graph, ``time_us`` times replays."""

    def __init__(self, model, batch, context, compiled=False):
        import torch
        self.torch, self.graph, self.logits = torch, None, None
        device = model.device
        self.cache = static_cache(model, batch, context + 1)
        self.context = context
        self.ids = torch.full((batch, 1), 3, dtype=torch.long, device=device)
        self.kwargs = {cache_keyword(model): self.cache, "use_cache": True,
                       "position_ids": torch.full((batch, 1), context, dtype=torch.long, device=device)}
        if takes(model.forward, "cache_position"):
            self.kwargs["cache_position"] = torch.tensor([context], dtype=torch.long, device=device)
        self.forward = torch.compile(model.forward, fullgraph=True, dynamic=False) if compiled else model.forward

    def __call__(self):
        rewind(self.cache, self.context)
        return self.forward(input_ids=self.ids, **self.kwargs).logits

    def capture(self):
        torch = self.torch
        if self.ids.device.type != "cuda":
            with torch.no_grad():
                for _ in range(WARMUP):
                    self.logits = self()
            return self
        with torch.no_grad():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(WARMUP):
                    self()
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.logits = self()
        torch.cuda.synchronize()
        return self

    def time_us(self, replays):
        if self.graph is None:
            with self.torch.no_grad():
                return time_us(self, replays, self.torch, cuda=False)
        return time_us(self.graph.replay, replays, self.torch)


class Prefill:
    """One forward of ``model`` over ``ids`` (no cache), eager."""

    def __init__(self, model, ids):
        import torch
        self.torch, self.model, self.ids = torch, model, ids

    def __call__(self):
        with self.torch.inference_mode():
            return self.model(input_ids=self.ids, use_cache=False).logits

    def capture(self):
        self()                       # warm-up: cuBLAS workspaces, SDPA's first call
        if self.ids.device.type == "cuda":
            self.torch.cuda.synchronize()
        return self

    def time_us(self, replays):
        return time_us(self, replays, self.torch, cuda=self.ids.device.type == "cuda")


def time_us(call, replays, torch, cuda=True):
    """Microseconds per call after one untimed call: CUDA events around ``replays`` calls, or the host clock."""
    call()
    if not cuda:
        import time
        t0 = time.perf_counter()
        for _ in range(replays):
            call()
        return (time.perf_counter() - t0) * 1e6 / replays
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / replays


# -- what is measured, and the summary (torch-free) ---------------------------------------------------
def measures(step_modes, batches, prefill):
    """[(measure, mode, batch)]: decode per step mode and batch, then the prefill (eager: GEMMs dwarf launches)."""
    out = [("decode", mode, b) for mode in step_modes for b in batches]
    return out + ([("prefill", "eager", 1)] if prefill else [])


def interleaved_rounds(timers, repeats, log, deadline=None, clock=None):
    """Rounds over ``timers`` ({key: fn() -> us}); a timer that raises drops out. (samples, errors, notes)."""
    import time
    clock = clock or time.perf_counter
    samples, errors, notes, failed = [], [], [], set()
    started = None
    for rnd in range(repeats):
        now = clock()
        if deadline is not None and started is not None and now + (now - started) > deadline:
            notes.append(f"serving: the time budget stopped the rounds after {rnd} of {repeats}")
            break
        started = now
        for key, timer in timers.items():
            if key in failed:
                continue
            try:
                samples.append({"key": list(key), "round": rnd, "us": timer()})
            except Exception as e:  # noqa: BLE001 - one failing timer must not end the run
                failed.add(key)
                errors.append({"where": f"{' '.join(map(str, key))} round {rnd}", "error": str(e)[:400]})
                log(f"error: {key}: {e}")
    return samples, errors, notes


def summarize(samples, baselines=("hf",)):
    """A row per (measure, mode, batch, variant): the spread over rounds, its median over hf's (same mode, compiled)."""
    by_key = {}
    for s in samples:
        by_key.setdefault(tuple(s["key"]), []).append(s["us"])
    rows = [{"measure": measure, "mode": mode, "batch": batch, "variant": variant, "us": report.spread(values)}
            for (measure, mode, batch, variant), values in by_key.items()]
    for row in rows:
        def median_of(mode, variant):
            return next((r["us"]["median"] for r in rows if (r["measure"], r["mode"], r["batch"], r["variant"])
                         == (row["measure"], mode, row["batch"], variant)), None)
        hf_same, hf_compiled = median_of(row["mode"], "hf"), median_of("compiled", "hf")
        row["vs_hf"] = row["us"]["median"] / hf_same if hf_same else None
        row["vs_hf_compiled"] = row["us"]["median"] / hf_compiled if hf_compiled else None
    order = {"decode": 0, "prefill": 1}
    return sorted(rows, key=lambda r: (order[r["measure"]], r["batch"], STEP_MODES.index(r["mode"]), r["variant"]
                                       != "hf", r["variant"]))
