"""What the chunked custom ops (memcompile/loss_ops.py, mlp_ops.py) share."""

from __future__ import annotations

import contextlib

import torch


def without_autocast(device: torch.device):
    """The op computes in its inputs' dtypes: the rewrite casts them as autocast would, and an
    autocast region around the compiled step must not cast again inside."""
    if torch.is_autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()
