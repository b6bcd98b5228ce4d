"""The sampler's parts: batched logit processors, top-k/top-p/min-p truncation and the draw,
and the plain per-row reference they are tested against. engine.sampler.Sampler is the entry."""
