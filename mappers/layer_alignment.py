"""Layer alignment: target layer j draws from source layers at the same relative depth.

Target layer ``j`` of ``Lt`` sits at depth ``j / (Lt - 1)``; its centre source layer
is ``round(j / (Lt - 1) * (Ls - 1))``. The window takes ``radius`` neighbours on
each side; near the ends it is *shifted* inside ``[0, Ls)`` rather than cut, so
every target layer gets the same number of source layers (``min(2*radius+1, Ls)``)
and the maps of all layers can be stacked and applied with one batched matmul.
"""

from __future__ import annotations

import torch


def center_layers(num_source: int, num_target: int) -> torch.Tensor:
    """``[num_target]`` source layer at each target layer's relative depth."""
    if num_source < 1 or num_target < 1:
        raise ValueError("layer counts must be >= 1")
    if num_target == 1:
        return torch.tensor([num_source - 1], dtype=torch.long)
    j = torch.arange(num_target, dtype=torch.float64)
    return torch.round(j / (num_target - 1) * (num_source - 1)).to(torch.long)


def align_layers(num_source: int, num_target: int, *, radius: int = 1) -> torch.Tensor:
    """``[num_target, width]`` source layer indices per target layer, sorted ascending.

    ``width = min(2 * radius + 1, num_source)``; column ``radius`` (when not shifted)
    is the centre layer.
    """
    if radius < 0:
        raise ValueError("radius must be >= 0")
    width = min(2 * radius + 1, num_source)
    centre = center_layers(num_source, num_target)
    start = (centre - radius).clamp(min=0, max=num_source - width)
    return start[:, None] + torch.arange(width, dtype=torch.long)[None, :]
