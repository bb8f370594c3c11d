"""CPU paged-attention kernel (C++ extension, JIT-built on first use) for decode and verification steps.

The source is ``csrc/paged_attention.cpp``; :func:`load_cpu_kernel` builds it with
``torch.utils.cpp_extension.load`` (``-O3 -march=native``) into torch's extension cache
(``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions/<py>_<torch>/``), so only the first
use on a machine compiles (~25 s on a 2-core machine); later processes load the cached ``.so``. The build is rerun
automatically when the source or flags change. ``-march=native`` ties a build to the host CPU, so the
extension name carries a hash of the CPU's feature flags: hosts sharing a cache directory but differing
in CPU features get separate builds (and never load code with instructions they lack).

Builds are serialised by an OS lock (``fcntl.flock`` on ``magicserve.build.lock`` in the build directory),
which the kernel releases when the holder exits, however it exits. torch's own lock (a ``lock`` file that
its builder deletes when done) outlives a builder that is killed mid-build, and every later load would
then wait for it forever; whoever holds the OS lock knows no other magicserve build is running, so a
``lock`` file it finds is stale and is removed.

Set ``MAGICSERVE_DISABLE_CPU_KERNEL=1`` to skip the kernel (``auto`` then resolves to torch).

:class:`CpuPagedAttentionBackend` runs the kernel for steps whose longest query block is at most
``max_q_len`` tokens (decode, k+1 verification) and hands longer steps (prefill chunks) to
:class:`~modeling.attention.torch_backend.TorchAttentionBackend`, whose per-block gemms suit them better.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import math
import os
import platform
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

from modeling.attention.metadata import AttentionMetadata
from modeling.attention.torch_backend import TorchAttentionBackend

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"
_EXT_BASE_NAME = "magicserve_paged_attention"
_CFLAGS = ["-O3", "-march=native", "-fno-math-errno"]
# Steps whose longest per-sequence query block exceeds this go to the torch backend.
DEFAULT_MAX_Q_LEN = 16

_lock = threading.Lock()
_module: ModuleType | None = None
_error: str | None = None
_build_seconds: float | None = None


def _cpu_fingerprint() -> str:
    """Short hash of the CPU model and feature flags (what -march=native compiles for)."""
    text = platform.machine() + platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "model name", "Features")):
                    text += line
                if line.strip() == "":  # the first processor is enough
                    break
    except OSError:
        pass
    return hashlib.sha1(text.encode()).hexdigest()[:10]


@contextlib.contextmanager
def exclusive_build(build_dir: str):
    """Hold the OS-level build lock of ``build_dir``; remove a stale torch ``lock`` file found under it.

    Blocks while another process holds the lock (builds serialise); the kernel drops the lock when the holder
    exits, so a killed builder never blocks the next one."""
    os.makedirs(build_dir, exist_ok=True)
    with open(os.path.join(build_dir, "magicserve.build.lock"), "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = os.path.join(build_dir, "lock")
            if os.path.exists(stale):
                log.warning("removing a stale extension build lock %s (its builder did not finish)", stale)
                os.remove(stale)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def load_cpu_kernel() -> ModuleType:
    """The compiled extension (built on the first call; cached in-process and on disk).

    Raises RuntimeError with the compiler's message when the build fails."""
    global _module, _error, _build_seconds
    if _module is not None:
        return _module
    with _lock:
        if _module is not None:
            return _module
        if _error is not None:
            raise RuntimeError(_error)
        from torch.utils import cpp_extension

        t0 = time.perf_counter()
        name = f"{_EXT_BASE_NAME}_{_cpu_fingerprint()}"
        try:
            with exclusive_build(cpp_extension._get_build_directory(name, verbose=False)):
                _module = cpp_extension.load(
                    name=name,
                    sources=[str(_SOURCE)],
                    extra_cflags=_CFLAGS,
                    extra_ldflags=[],
                    with_cuda=False,
                    verbose=False,
                )
        except Exception as err:  # compiler missing, compile error, ninja missing, ...
            _error = f"cpu attention kernel: build of {_SOURCE.name} failed: {type(err).__name__}: {err}"
            raise RuntimeError(_error) from err
        _build_seconds = time.perf_counter() - t0
        log.debug("cpu attention kernel loaded in %.1fs (%s)", _build_seconds, _module.build_info())
        return _module


def cpu_kernel_available() -> bool:
    """True when the kernel builds/loads here. Tries once per process; a failure logs a warning."""
    if _module is not None:
        return True
    if _error is not None:
        return False
    if os.environ.get("MAGICSERVE_DISABLE_CPU_KERNEL"):  # opt-out, e.g. to force the torch backend
        return False
    try:
        load_cpu_kernel()
    except RuntimeError as err:
        log.warning("%s; falling back to the torch attention backend", err)
        return False
    return True


def cpu_kernel_error() -> str | None:
    """Why the kernel is unavailable (None when it built or was not tried)."""
    if _error is None and _module is None and os.environ.get("MAGICSERVE_DISABLE_CPU_KERNEL"):
        return "disabled by MAGICSERVE_DISABLE_CPU_KERNEL"
    return _error


def cpu_kernel_build_seconds() -> float | None:
    """Wall time of this process's load (compile + link on a cold cache, import otherwise)."""
    return _build_seconds


def paged_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float | None = None,
                    sliding_window: int | None = None) -> torch.Tensor:
    """Run the kernel on one step (any q_len; see CpuPagedAttentionBackend for the dispatch).
    ``sliding_window``: the layer's window (None: full attention)."""
    t = meta.tensors(q.device)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return load_cpu_kernel().paged_attention(
        q, k_cache, v_cache, t["block_tables"], t["seq_lens"], t["query_start"],
        meta.sink_len, t["window_starts"], scale, sliding_window or 0,
    )


class CpuPagedAttentionBackend:
    """Paged attention through the C++ kernel; long query blocks go to the torch backend."""

    name = "cpu"

    def __init__(self, max_q_len: int = DEFAULT_MAX_Q_LEN):
        self._op = load_cpu_kernel().paged_attention  # raises RuntimeError when unavailable
        self.max_q_len = max_q_len
        self._fallback = TorchAttentionBackend()

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D] (already in the cache, unused here);
        k_cache, v_cache: [num_blocks, block_size, Hkv, D]. Returns [T, Hq, D]. ``sliding_window``: the
        layer's window (None: full attention), applied in the kernel."""
        qs = meta.query_start
        # Fast accept for pure decode / short verification steps: T <= max_q_len means no block can be
        # longer; otherwise check each sequence (O(B) Python, small next to the attention itself).
        if qs[-1] > self.max_q_len and any(e - s > self.max_q_len for s, e in zip(qs, qs[1:])):
            return self._fallback.forward(q, k, v, k_cache, v_cache, meta, sliding_window)
        t = meta.tensors(q.device)
        return self._op(
            q, k_cache, v_cache, t["block_tables"], t["seq_lens"], t["query_start"],
            meta.sink_len, t["window_starts"], 1.0 / math.sqrt(q.shape[-1]), sliding_window or 0,
        )
