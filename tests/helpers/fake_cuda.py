"""Tensors on ``"cuda"`` without a GPU: the engine's CUDA branches under torch's
``FakeTensorMode``, so that a device mix (a CPU tensor and a CUDA tensor in one op)
fails CI on a machine with no GPU.

``FakeTensorMode`` runs every op on shapes, dtypes and devices only, and raises
``FakeTensorDeviceMismatchError`` where an op mixes devices, as CUDA would. Two things a
CPU build of torch lacks are supplied here, both stand-ins for what needs a GPU:

* a CUDA *device guard*: Python indexing (``t[a:b]``) and ``copy_`` of fake CUDA
  tensors enter one, and a CPU build has none registered ("PyTorch is not linked with
  support for cuda devices"). A three-line C++ extension registers c10's own
  ``FakeGuardImpl<CUDA>`` (built once with torch's ``load_inline``, cached in
  ``~/.cache/torch_extensions``; ~20 s the first time);
* CUDA streams and events (``torch.cuda.current_stream()``, ``Event``, ``Stream``):
  no-op objects with the methods the engine calls, patched in for the duration.

Data-dependent ops (``.item()``, ``.tolist()``, ``nonzero``) raise
``DataDependentOutputException`` / ``DynamicOutputShapeException`` under the mode: a test
runs a path *up to* its first one, and asserts that it got there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import cache
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

_GUARD_SOURCE = r"""
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>
namespace {
C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>);
}
"""


@cache
def register_fake_cuda_guard() -> None:
    """Register a fake CUDA device guard in this process (once); a no-op where torch
    has CUDA (its real guard is there)."""
    if torch.version.cuda is not None:
        return
    from torch.utils.cpp_extension import load_inline

    load_inline("nrr_fake_cuda_guard", cpp_sources=[_GUARD_SOURCE], functions=[])


class FakeEvent:
    """``torch.cuda.Event`` without a device: records nothing, always done."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.recorded = 0

    def record(self, stream: object = None) -> None:
        self.recorded += 1

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def wait(self, stream: object = None) -> None:
        pass


class FakeStream:
    """``torch.cuda.Stream`` without a device."""

    def __init__(self, device: object = None, *args: object, **kwargs: object) -> None:
        self.device = torch.device("cuda", 0) if device is None else torch.device(device)
        self.synchronized = 0

    def synchronize(self) -> None:
        self.synchronized += 1

    def wait_event(self, event: object) -> None:
        pass

    def wait_stream(self, stream: object) -> None:
        pass

    def record_event(self, event: object = None) -> FakeEvent:
        return FakeEvent()

    def query(self) -> bool:
        return True


@contextlib.contextmanager
def fake_cuda() -> Iterator[FakeTensorMode]:
    """A ``FakeTensorMode`` in which ``torch.empty(..., device="cuda")`` makes a fake CUDA
    tensor and any op that mixes devices raises; CUDA streams and events are no-ops."""
    register_fake_cuda_guard()
    streams: dict[object, FakeStream] = {}

    def current_stream(device: object = None) -> FakeStream:
        key = torch.device("cuda", 0) if device is None else torch.device(device)
        return streams.setdefault(key, FakeStream(key))

    patches = [
        mock.patch("torch.cuda.current_stream", current_stream),
        mock.patch("torch.cuda.Event", FakeEvent),
        mock.patch("torch.cuda.Stream", FakeStream),
        mock.patch("torch.cuda.stream", lambda s: contextlib.nullcontext()),
        mock.patch("torch.cuda.synchronize", lambda device=None: None),
    ]
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        yield stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
