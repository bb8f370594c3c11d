"""``model.dtype: auto``: bfloat16 where the hardware computes it natively, float32 elsewhere on CPU.

A CPU without bf16 dot products (AVX512-BF16, AMX, or Arm's BF16 extension) runs bf16 matrix products by
converting to float32 and back: a 2K-token prefill of the bundled model then takes about twice as long in
bf16 as in float32 (``benchmarks/dtype_choice.py`` measures both on the machine it runs on). So ``auto``
picks:

* on CUDA, bfloat16 where the GPU computes it (compute capability 8.0 and later), float16 on older GPUs;
  a controller without a GPU of its own plans CUDA pools in bfloat16 (every GPU since the A100);
* on CPU, bfloat16 where the CPU has native bf16 arithmetic and torch's kernels may use it
  (``ONEDNN_MAX_CPU_ISA`` below ``AVX512_CORE_BF16``, or ``ATEN_CPU_CAPABILITY`` below ``avx512``, forbids
  it), float32 elsewhere. The CPU extension's bf16 kernel (``modeling/cpu_linear.py``) honours the same caps.

Every choice carries its reason, which ``magicserve serve`` prints on its first line and ``magicserve status``
reports. An explicit ``float32``, ``bfloat16`` or ``float16`` is taken as it is.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

AUTO = "auto"
# oneDNN ISA caps (ONEDNN_MAX_CPU_ISA) under which its bf16 kernels emulate bf16 in float32
_ONEDNN_ISAS_WITHOUT_BF16 = frozenset({"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE",
                                       "AVX512_CORE_VNNI"})
# ATEN_CPU_CAPABILITY values that keep torch's own kernels (and the code torch.compile generates) off AVX-512
_ATEN_CAPS_WITHOUT_AVX512 = frozenset({"DEFAULT", "AVX2"})
# /proc/cpuinfo flags of native bf16 arithmetic: x86 (AVX512-BF16, AMX-BF16) and Arm (FEAT_BF16)
_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype a pool runs and why."""

    dtype: str  # float32 | bfloat16 | float16
    reason: str

    def describe(self) -> str:
        return f"{self.dtype} ({self.reason})"


def cpu_flags(path: str = "/proc/cpuinfo") -> set[str]:
    """The first processor's feature flags (x86 ``flags``, Arm ``Features``); empty where unreadable."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return set(value.split())
    except OSError:
        pass
    return set()


def cpu_native_bf16(flags: set[str] | None = None, environ: dict | None = None) -> tuple[bool, str]:
    """Whether torch's CPU kernels compute bf16 natively here, and the evidence in words."""
    flags = cpu_flags() if flags is None else flags
    environ = os.environ if environ is None else environ
    have = [f for f in _BF16_FLAGS if f in flags]
    if not have:
        kind = "AVX-512 without AVX512-BF16" if "avx512f" in flags else (
            "AVX2 without AVX-512" if "avx2" in flags else "no AVX512-BF16, AMX or BF16")
        return False, f"this CPU has no native bf16 arithmetic ({kind}): bf16 would be emulated in float32"
    cap = environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    if cap in _ONEDNN_ISAS_WITHOUT_BF16:
        return False, f"ONEDNN_MAX_CPU_ISA={cap} keeps oneDNN off this CPU's bf16 instructions"
    aten = environ.get("ATEN_CPU_CAPABILITY", "").strip().upper()
    if aten in _ATEN_CAPS_WITHOUT_AVX512:
        return False, f"ATEN_CPU_CAPABILITY={aten.lower()} keeps torch's kernels off this CPU's bf16 instructions"
    return True, f"this CPU computes bf16 natively ({', '.join(have)})"


def choose_dtype(requested: str, device: str, flags: set[str] | None = None,
                 environ: dict | None = None) -> DtypeChoice:
    """The dtype for ``requested`` (``auto`` or a dtype name) on ``device`` (``cpu`` or ``cuda``)."""
    if requested != AUTO:
        return DtypeChoice(requested, "set in the config")
    if device == "cuda":
        return _cuda_choice()
    native, why = cpu_native_bf16(flags, environ)
    return DtypeChoice("bfloat16" if native else "float32", why)


def _cuda_choice() -> DtypeChoice:
    import torch

    if not torch.cuda.is_available():
        return DtypeChoice("bfloat16", "CUDA pools, planned on a host without a GPU: GPUs since the A100 compute "
                                       "bf16 (set float16 for older ones)")
    major, minor = torch.cuda.get_device_capability()
    if major >= 8:
        return DtypeChoice("bfloat16", f"this GPU computes bf16 (compute capability {major}.{minor})")
    return DtypeChoice("float16", f"this GPU has no bf16 arithmetic (compute capability {major}.{minor})")
