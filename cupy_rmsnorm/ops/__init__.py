"""The op families, one package each: its public functions, specs, checks, layout, plans,
launchers, reference and torch ops. Importing a family registers its specs with the pipeline
(``_pipeline.REGISTRY``), in the order below, which is the order of the public API."""

from . import forward, quant, backward, gated, qk_rope, layer_norm  # noqa: F401, I001 - the registration order
