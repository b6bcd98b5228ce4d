"""Everything that touches tensors: model runner, attention, sampler, loader, cost model."""
