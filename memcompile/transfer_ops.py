"""Asynchronous copies between device and host memory, as graph ops (public torch APIs only).

An offloaded activation takes four ops in the rewritten graphs:

    forward:   h = copy_to_host(x)                 copy starts on the transfer stream
               h = wait_copy(h, keepalive=x)       after x's last forward reader: the compute
                                                   stream waits for the copy, then x may be freed
    backward:  y = copy_to_device(h, size, stride) issued early (prefetch), on the transfer stream
               y = wait_copy(y)                    just before y's first reader

`wait_copy` returns its input (an alias, declared in its schema), so the compilers keep every
reader after it; its `keepalive` argument keeps the source of an in-flight copy from being freed
(Inductor frees a buffer after its last reader) without `record_stream`. Compilers order ops by
data alone (Inductor ran a forward wait right after its copy, which stalls the compute stream
until the copy ends), so `after` (ignored when run) pins a reload or a wait behind the tensor
the rewrite placed it after.

On CUDA the copies run on one transfer stream per device, so a reload is also ordered after the
offload of the same tensor. Elsewhere (the CPU test switch `offload=True`) the same ops are plain
synchronous copies, so the rewrite is tested here with the graphs the GPU runs.
"""

from __future__ import annotations

from typing import Optional

import torch

_transfer_streams: dict[torch.device, torch.cuda.Stream] = {}
# Completion event of each copy in flight, by the data pointer of the copy's result; popped by wait_copy.
_in_flight: dict[int, torch.cuda.Event] = {}


def _transfer_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _transfer_streams:
        _transfer_streams[device] = torch.cuda.Stream(device=device)
    return _transfer_streams[device]


def _copy_async(src: torch.Tensor, dst: torch.Tensor, device: torch.device) -> None:
    """dst.copy_(src) on the transfer stream, after everything queued so far on the compute stream
    (which made src, and last used dst's memory)."""
    stream = _transfer_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    _in_flight[dst.data_ptr()] = done


@torch.library.custom_op("memcompile::copy_to_host", mutates_args=())
def copy_to_host(x: torch.Tensor) -> torch.Tensor:
    if x.device.type != "cuda":
        return x.clone()
    # Pinned host memory: the copy is a DMA the device runs without the CPU (and is asynchronous).
    host = torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device="cpu", pin_memory=True)
    _copy_async(x, host, x.device)
    return host


@copy_to_host.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    host = "cpu" if x.device.type == "cuda" else x.device  # off CUDA the "host" copy stays where x is
    return torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device=host)


@torch.library.custom_op("memcompile::copy_to_device", mutates_args=())
def copy_to_device(host: torch.Tensor, device: torch.device, size: list[int], stride: list[int],
                   after: Optional[torch.Tensor] = None) -> torch.Tensor:
    # Allocated on the compute stream (the allocator's ownership stays simple); the transfer
    # stream first waits for the compute stream, so earlier users of this memory are done.
    out = torch.empty_strided(size, stride, dtype=host.dtype, device=device)
    if out.device.type != "cuda":
        out.copy_(host)
        return out
    _copy_async(host, out, out.device)
    return out


@copy_to_device.register_fake
def _(host: torch.Tensor, device: torch.device, size: list[int], stride: list[int],
      after: Optional[torch.Tensor] = None) -> torch.Tensor:
    return torch.empty_strided(size, stride, dtype=host.dtype, device=device)


_library = torch.library.Library("memcompile", "FRAGMENT")
_library.define("wait_copy(Tensor(a) copied, Tensor? keepalive=None, Tensor? after=None) -> Tensor(a)")


def _wait_copy(copied: torch.Tensor, keepalive: torch.Tensor | None = None,
               after: torch.Tensor | None = None) -> torch.Tensor:
    done = _in_flight.pop(copied.data_ptr(), None)
    if done is not None:  # a CUDA copy: one side of it is on the device
        device = copied.device if copied.is_cuda else keepalive.device
        torch.cuda.current_stream(device).wait_event(done)
    return copied


torch.library.impl(_library, "wait_copy", "CompositeExplicitAutograd")(_wait_copy)
torch.library.register_fake("memcompile::wait_copy", lib=_library)(lambda copied, keepalive=None, after=None: copied)
# Nothing reads what wait_copy does to the streams: without this, dead-code elimination could drop it.
torch.fx.node.has_side_effect(torch.ops.memcompile.wait_copy.default)

COPY_TO_HOST = torch.ops.memcompile.copy_to_host.default
COPY_TO_DEVICE = torch.ops.memcompile.copy_to_device.default
WAIT_COPY = torch.ops.memcompile.wait_copy.default


def copies_in_flight() -> int:
    """Copies issued and not yet waited for (0 after every complete step; tests check it)."""
    return len(_in_flight)
