"""Where sglang 0.5.23 itself, not sgl_kernel, keeps Qwen3.5 off a CPU without AMX (CPU test harness only).

Its gated RMS norm (`sglang/kernels/ops/attention/fla/layernorm_gated.py`, the linear-attention layers' output norm)
takes the CPU op `fused_rmsnorm_gated_cpu` only when `cpu_has_amx_support()`; on any other CPU it falls through to
a Triton kernel that asks CUDA for its SM count ("Torch not compiled with CUDA enabled"). There is no switch for it.
This module makes that norm take the CPU op on every CPU, by setting the module's `_use_cpu` flag to `is_cpu()` as
soon as sglang imports it (a meta-path hook, since sglang imports sgl_kernel first). Every other AMX-gated path
keeps SGLang's own choice.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

GATED_NORM = "sglang.kernels.ops.attention.fla.layernorm_gated"


def _take_cpu_op(module) -> None:
    from sglang.srt.utils import is_cpu

    module._use_cpu = is_cpu()


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        self.inner.exec_module(module)
        _take_cpu_op(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != GATED_NORM:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    if GATED_NORM in sys.modules:
        _take_cpu_op(sys.modules[GATED_NORM])
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
