"""SGLang 0.5.23's model classes on CPU (the venv of scripts/setup_sglang_cpu.sh).

Foundation only: what makes ``sglang.srt.models.qwen3`` and ``qwen3_moe`` import on a CPU
torch. Stand-ins (each one unavoidable, each listed here):

1. ``torchvision``: SGLang's ``sglang.srt.configs`` imports ``torchvision.transforms`` at
   module level (InternVL / DeepSeek-VL2 / DeepSeek-OCR preprocessing), and transformers'
   image processors import ``torchvision.transforms.v2``. The only torchvision wheels here
   are CUDA builds whose ``_C.so`` needs ``libc10_cuda.so``, so importing one on the CPU
   torch fails (``operator torchvision::nms does not exist``). ``stub_torchvision()``
   answers every ``torchvision.*`` import with an empty module whose attributes are inert
   classes, except ``InterpolationMode`` (an enum: SGLang's transformers patches read its
   members). No text model path calls torchvision.

Not done yet (see the helper's report): SGLang's parallel state over gloo, the global
server args, building Qwen3 and ``load_weights``.
"""

from __future__ import annotations

import enum
import importlib.abc
import importlib.machinery
import sys
import types


class InterpolationMode(enum.Enum):
    """The members of torchvision's enum that SGLang and transformers read."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class _StubModule(types.ModuleType):
    """A torchvision module: any public name is an inert class (never called on text)."""

    def __getattr__(self, name: str) -> object:
        if name.startswith("__"):
            raise AttributeError(name)
        if name == "InterpolationMode":
            return InterpolationMode
        return type(name, (), {"__init__": lambda self, *args, **kwargs: None})


class _TorchvisionFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers ``torchvision`` and every submodule with a ``_StubModule`` package."""

    def find_spec(self, name: str, path: object = None, target: object = None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _StubModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__path__ = []
        module.__version__ = "0.28.0"  # the version that pairs with torch 2.13


def stub_torchvision() -> None:
    """Install stand-in 1 before anything imports sglang (idempotent)."""
    if not any(isinstance(f, _TorchvisionFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchvisionFinder())


def import_sglang_models() -> None:
    """Import SGLang's Qwen3 dense and MoE model modules on CPU."""
    stub_torchvision()
    import sglang.srt.models.qwen3  # noqa: F401
    import sglang.srt.models.qwen3_moe  # noqa: F401
