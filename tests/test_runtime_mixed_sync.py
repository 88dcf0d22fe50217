"""How a stage whose replicas run different TP degrees agrees on each parameter's
layout before it averages gradients chunk by chunk (hetplan.runtime.mixed), without processes."""

from __future__ import annotations

import pytest

from hetplan.errors import HetplanError
from hetplan.runtime.mixed import ParamLayout, agree_layouts

# the views of a tp-2 replica's two ranks and a tp-1 replica's rank: name -> (full shape, local shape, sharded dim)
TP2 = {"w": ((8, 4), (4, 4), 0), "b": ((4,), (4,), None)}
TP1 = {"w": ((8, 4), (8, 4), None), "b": ((4,), (4,), None)}


def test_the_sharded_dimension_comes_from_the_replicas_that_shard() -> None:
    layouts = agree_layouts([TP2, TP2, TP1], [2, 2, 1], tp=2)
    assert layouts == {"w": ParamLayout((8, 4), 0), "b": ParamLayout((4,), None)}


@pytest.mark.parametrize("views, degrees, tp, message", [
    ([TP2, {**TP2, "w": ((8, 4), (8, 2), 1)}, TP1], [2, 2, 1], 2, "laid out differently by the replicas"),
    ([{**TP2, "w": ((6, 4), (2, 4), 0)}, {**TP1, "w": ((6, 4), (6, 4), None)}], [4, 1], 4,
     "which tp=4 does not divide"),
    ([{**TP2, "b": ((4,), (2,), None)}, TP1], [2, 1], 2, "sharded outside DTensor"),
    ([TP2, {"b": TP1["b"]}], [2, 1], 2, "laid out differently by the replicas"),
])
def test_layouts_the_chunked_average_cannot_follow_are_refused(views, degrees, tp, message) -> None:
    with pytest.raises(HetplanError, match=message):
        agree_layouts(views, degrees, tp)
