"""The matmul work of one call, forward and backward together: floating-point operations of every
matrix product the call runs, counted by torch's `FlopCounterMode` (mm, addmm, bmm, matmul and the
rest of its table), wherever they run: in the forward, inside autograd Functions, in the backward.
Its table has no in-place products, with which routines accumulate a gradient over chunks
(`grad.addmm_(g.T, h)`): they are added, with torch's own formulas. Elementwise work is not
counted. What a frozen input's gradient must not cost (`frozen-input-work`)."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode


def _as_registered(out_of_place: Any) -> Callable[..., int]:
    """torch's formula of an out-of-place product, as its table holds it (it takes the op's
    arguments), for the in-place one."""
    formula = flop_counter.flop_registry[out_of_place]

    def count(*args: Any, **kwargs: Any) -> int:
        return formula(*args, **kwargs)
    count._get_raw = True  # type: ignore[attr-defined]  # FlopCounterMode: already takes the arguments
    return count


_aten = torch.ops.aten
IN_PLACE = {_aten.addmm_: _as_registered(_aten.addmm), _aten.baddbmm_: _as_registered(_aten.baddbmm)}


class Work:
    """Counts while `counting()` is entered, summed over its entries (a forward, then a backward);
    `total` is None until something was counted."""

    def __init__(self) -> None:
        self._mode = FlopCounterMode(display=False, custom_mapping=IN_PLACE)
        self.total: int | None = None

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        with self._mode:  # entering clears its counts
            yield
        self.total = (self.total or 0) + self._mode.get_total_flops()
