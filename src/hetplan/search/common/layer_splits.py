"""Contiguous layer splits the papers' planners start from."""

from __future__ import annotations

from hetplan.model.spec import ModelSpec


def even_split(num_layers: int, pp: int) -> list[range]:
    """Contiguous layer ranges of (nearly) equal counts; earlier stages get the
    extra layer when the count does not divide."""
    base, extra = divmod(num_layers, pp)
    ranges, start = [], 0
    for j in range(pp):
        size = base + (1 if j < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


def block_split(model: ModelSpec, pp: int) -> list[range]:
    """Megatron-LM's split (and Galvatron-Base's "ideally balanced" one): the
    repeated blocks evenly over the stages (earlier stages get the extra one),
    the leading embedding on the first stage and the trailing head on the
    last. Falls back to an even split of all layers when there are fewer
    blocks than stages."""
    layers = model.layers
    first = 0
    while first < len(layers) and layers[first].kind == "embedding":
        first += 1
    last = len(layers)
    while last > first and layers[last - 1].kind == "head":
        last -= 1
    if last - first < pp:
        return even_split(len(layers), pp)
    ranges = [range(r.start + first, r.stop + first) for r in even_split(last - first, pp)]
    ranges[0] = range(0, ranges[0].stop)
    ranges[-1] = range(ranges[-1].start, len(layers))
    return ranges
