"""bf16 linear layers of small CPU steps through the CPU extension's ``skinny_linear`` kernel.

A decode or verification step multiplies a few rows by every weight matrix once: a stream over the weights,
bound by memory bandwidth, where torch's bf16 GEMM for a handful of rows reads them far below the machine's
bandwidth (``benchmarks/decode_step.py`` measures both). :func:`use_skinny_linear` routes the model's bf16
``nn.Linear`` layers through the kernel (``modeling/attention/csrc/skinny_linear.cpp``) for inputs of at
most :data:`MAX_ROWS` rows, leaving larger steps (prefill chunks, big batches) to torch, and is applied from
outside the model like tensor parallelism. It runs with the ``cpu`` attention backend (the same extension),
on CPUs with AVX512-BF16 that torch's kernels may use (the ISA caps ``modeling/dtype_choice.py`` honours);
elsewhere every layer stays on torch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from modeling.attention.cpu_kernel import cpu_kernel_available, load_cpu_kernel
from modeling.dtype_choice import cpu_native_bf16

# Steps with more rows than this go to torch's GEMM (measured faster at 16 rows, break-even near 32).
MAX_ROWS = 16


def skinny_linear_available() -> bool:
    """True when the CPU extension is built, this CPU has the kernel's instructions and no ISA cap set for torch
    (``ONEDNN_MAX_CPU_ISA``, ``ATEN_CPU_CAPABILITY``) keeps it off them."""
    return cpu_kernel_available() and bool(load_cpu_kernel().skinny_linear_supported()) and cpu_native_bf16()[0]


def _eligible(module: nn.Module) -> bool:
    w = getattr(module, "weight", None)
    return (isinstance(module, nn.Linear) and w.dtype == torch.bfloat16 and w.device.type == "cpu"
            and w.is_contiguous() and module.in_features % 32 == 0)


def use_skinny_linear(model: nn.Module, max_rows: int = MAX_ROWS) -> int:
    """Route every eligible bf16 ``nn.Linear`` of ``model`` (CPU, contiguous weight, input width a multiple of
    32) through the kernel for 2-D inputs of at most ``max_rows`` rows. Returns how many layers were routed
    (0 when the kernel is unavailable). Idempotent."""
    if not skinny_linear_available():
        return 0
    op = load_cpu_kernel().skinny_linear
    routed = 0
    for module in model.modules():
        if _eligible(module):
            # the same object when re-routed after unroute(): compiled graphs guard on it
            kept = module.__dict__.get("_skinny_forward")
            module.forward = kept if isinstance(kept, _SkinnyForward) and kept.max_rows == max_rows else (
                _SkinnyForward(module, op, max_rows))
            module._skinny_forward = module.forward
            routed += 1
    return routed


def unroute(model: nn.Module) -> None:
    """Undo :func:`use_skinny_linear`: every layer back on ``F.linear``."""
    for module in model.modules():
        if isinstance(module.__dict__.get("forward"), _SkinnyForward):
            del module.forward


def routed_layers(model: nn.Module) -> int:
    """How many of ``model``'s layers :func:`use_skinny_linear` routed."""
    return sum(isinstance(getattr(m, "forward", None), _SkinnyForward) for m in model.modules())


class _SkinnyForward:
    """A layer's forward: the kernel for small bf16 inference inputs, ``F.linear`` for everything else."""

    def __init__(self, module: nn.Linear, op, max_rows: int):
        self.module = module
        self.op = op
        self.max_rows = max_rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = self.module
        if (x.dim() == 2 and x.shape[0] <= self.max_rows and x.dtype == torch.bfloat16 and x.stride(1) == 1
                and not (torch.is_grad_enabled() and (x.requires_grad or m.weight.requires_grad))):
            # the weight may have been replaced since routing (a tied or resharded tensor): re-check its layout
            if m.weight.dtype == torch.bfloat16 and m.weight.is_contiguous():
                if torch.compiler.is_compiling():  # the operator form, which the compiled graph keeps
                    return torch.ops.magicserve.skinny_linear(x, m.weight, m.bias)
                return self.op(x, m.weight, m.bias)
        return F.linear(x, m.weight, m.bias)
