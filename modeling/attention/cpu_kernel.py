"""CPU paged-attention kernel (C++ extension, built once per machine) for decode and verification steps.

The source is ``csrc/paged_attention.cpp``; :func:`load_cpu_kernel` builds it with
``torch.utils.cpp_extension.load`` (``-O3 -march=native``, or the CPU that ``$MAGICSERVE_CPU_MARCH`` names;
ninja) into torch's extension cache (``$TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions/<py>_<torch>/``). ``magicserve build``
(:func:`build_cpu_kernel`) does it ahead of serving; otherwise the first process that needs the kernel
compiles it (tens of seconds) and later processes load the cached ``.so``.

The extension's name carries a hash of everything the build depends on: the CPU's feature flags (what
``-march=native`` compiles for), the compiler (``$CXX``), the flags, the source's path and text, and the
torch and Python it compiles against. Any process with the same inputs (a Ray worker of the same
virtualenv, whatever its thread settings) finds the same build directory with an up-to-date ``.so`` and
compiles nothing; builds that differ in any input (another checkout, virtualenv or CPU sharing the cache)
get directories of their own instead of rebuilding each other's.

Builds are serialised by an OS lock (``fcntl.flock`` on ``magicserve.build.lock`` in the build directory),
which the kernel releases when the holder exits, however it exits. torch's own lock (a ``lock`` file that
its builder deletes when done) outlives a builder that is killed mid-build, and every later load would
then wait for it forever; whoever holds the OS lock knows no other magicserve build is running, so a
``lock`` file it finds is stale and is removed.

A failed build is reported as one line naming the fallback (:data:`FALLBACK_NOTE`; the compiler's full
output goes to the DEBUG log) and is not retried within the process. Set ``MAGICSERVE_DISABLE_CPU_KERNEL=1``
to skip the kernel (``auto`` then resolves to torch).

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
import re
import shutil
import sys
import sysconfig
import threading
import time
import warnings
from pathlib import Path
from types import ModuleType

import torch

try:  # the ninja package's binary, for a virtualenv whose bin/ is not on PATH (_ensure_ninja_on_path)
    import ninja
except ImportError:  # ninja from PATH only (a failed build then falls back to the torch backend)
    ninja = None

from modeling.attention.metadata import AttentionMetadata
from modeling.attention.torch_backend import TorchAttentionBackend

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"
# Built into the same extension: the bf16 linear layers of small steps (modeling/cpu_linear.py).
_SOURCES = [_SOURCE, Path(__file__).parent / "csrc" / "skinny_linear.cpp"]
_EXT_BASE_NAME = "magicserve_paged_attention"
# -fopenmp: at::parallel_for is inline OpenMP in ATen's headers; compiled without it, the kernel's work items
# run one after another on the calling thread whatever torch's thread count (its OpenMP calls resolve to
# the runtime torch loaded, so torch.set_num_threads still sets the team size).
# Tuples: torch's builder appends to the lists it is given, which would change the fingerprint mid-process.
_CFLAGS = ("-O3", "-fno-math-errno", "-fopenmp")
_LDFLAGS = ("-fopenmp",)
DISABLE_ENV = "MAGICSERVE_DISABLE_CPU_KERNEL"
# The CPU the kernel is compiled for (gcc's -march): "native" (this CPU) unless set, e.g. "skylake-avx512" for
# AVX-512 without AVX512-BF16 or "haswell" for AVX2 only, to build for the oldest CPU of a mixed cluster (or
# to run this CPU as a lesser one). Part of the fingerprint, so each target has a build of its own.
MARCH_ENV = "MAGICSERVE_CPU_MARCH"
# How a failed build ends, in every message that reports one.
FALLBACK_NOTE = "attention falls back to the torch backend"
# Steps whose longest per-sequence query block exceeds this go to the torch backend.
DEFAULT_MAX_Q_LEN = 16

_lock = threading.Lock()
_module: ModuleType | None = None
_error: str | None = None
_build_seconds: float | None = None
_compiled: bool | None = None


def _cflags() -> tuple[str, ...]:
    """The compiler flags: :data:`_CFLAGS` and the target CPU (``-march``, from :data:`MARCH_ENV`)."""
    march = os.environ.get(MARCH_ENV, "").strip() or "native"
    if not re.fullmatch(r"[A-Za-z0-9_.+-]+", march):
        raise ValueError(f"{MARCH_ENV}: must be a gcc -march name such as native, skylake-avx512 or haswell, "
                         f"got {march!r}")
    return (*_CFLAGS, f"-march={march}")


def _cpu_fingerprint() -> str:
    """Short hash of everything a build depends on (it names the extension and so its build directory).

    The CPU's model and feature flags (what -march=native compiles for), the compiler, the flags, the
    source's path (torch's build file names it) and text, torch's and Python's headers and version. A
    process with the same inputs, in whatever environment otherwise, gets the same hash."""
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
    build = [os.environ.get("CXX", "c++"), *_cflags(), *_LDFLAGS, *map(os.path.abspath, _SOURCES), torch.__version__,
             os.path.dirname(torch.__file__), sysconfig.get_paths()["include"], sys.version]
    digest = hashlib.sha1(text.encode())
    digest.update("\0".join(build).encode())
    with contextlib.suppress(OSError):
        for source in _SOURCES:
            digest.update(source.read_bytes())
    return digest.hexdigest()[:10]


def _extension_name() -> str:
    return f"{_EXT_BASE_NAME}_{_cpu_fingerprint()}"


def _ensure_ninja_on_path() -> None:
    """torch runs ``ninja`` from PATH; when the ``ninja`` package is installed in a virtualenv that was not
    activated (``.venv/bin/magicserve demo``), put its binary's folder on this process's PATH."""
    if shutil.which("ninja") or ninja is None:
        return
    folder = getattr(ninja, "BIN_DIR", None)
    if folder and os.path.exists(os.path.join(folder, "ninja")):
        os.environ["PATH"] = folder + os.pathsep + os.environ.get("PATH", "")


def _short_reason(err: BaseException) -> str:
    """One line out of a build error: the compiler's first ``error`` line, else the error's first line."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    for line in lines[1:]:
        if "error" in line.lower() or "not found" in line.lower():
            reason = line
            break
    else:
        reason = lines[0] if lines else type(err).__name__
    return reason if len(reason) <= 200 else reason[:197] + "..."


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def _quiet_build():
    """Route what torch's builder says (Python warnings, its logger's warnings with tracebacks) to this
    module's DEBUG log, so that a failed build reports as one line."""
    torch_log = logging.getLogger("torch.utils.cpp_extension")
    collect, propagate = _Collect(), torch_log.propagate
    torch_log.addHandler(collect)
    torch_log.propagate = False
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        torch_log.removeHandler(collect)
        torch_log.propagate = propagate
        for message in collect.messages + [str(w.message) for w in caught]:
            log.debug("torch extension builder: %s", message)


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


def _mtime(path: str) -> int | None:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


def load_cpu_kernel() -> ModuleType:
    """The compiled extension (built on the first call unless cached on disk; cached in-process).

    Raises RuntimeError with a one-line reason when the build fails (the full output is logged at DEBUG);
    a failed build is not retried within the process."""
    global _module, _error, _build_seconds, _compiled
    if _module is not None:
        return _module
    with _lock:
        if _module is not None:
            return _module
        if _error is not None:
            raise RuntimeError(_error)
        from torch.utils import cpp_extension  # loads setuptools: only a build or a load of the kernel needs it

        t0 = time.perf_counter()
        _ensure_ninja_on_path()
        try:
            name = _extension_name()
            build_dir = cpp_extension._get_build_directory(name, verbose=False)
            with exclusive_build(build_dir), _quiet_build():
                before = _mtime(os.path.join(build_dir, f"{name}.so"))
                module = cpp_extension.load(
                    name=name,
                    sources=[str(s) for s in _SOURCES],
                    extra_cflags=list(_cflags()),
                    extra_ldflags=list(_LDFLAGS),
                    with_cuda=False,
                    verbose=False,
                )
                _compiled = _mtime(os.path.join(build_dir, f"{name}.so")) != before
        except Exception as err:  # compiler missing, compile error, ninja missing, ...
            _error = _short_reason(err)
            log.debug("cpu attention kernel: build of %s failed: %s: %s", _SOURCE, type(err).__name__, err)
            raise RuntimeError(_error) from err
        _module = module
        _build_seconds = time.perf_counter() - t0
        log.debug("cpu attention kernel %s in %.1fs (%s)", "built" if _compiled else "loaded", _build_seconds,
                  _module.build_info())
        return _module


def build_cpu_kernel() -> bool:
    """Build the kernel now (``magicserve build``), into the cache the serving processes load it from.

    True when this call compiled it, False when the cached build was current. Raises RuntimeError with a
    one-line reason when the build fails."""
    load_cpu_kernel()
    return bool(_compiled)


def cpu_kernel_library() -> str:
    """The shared library a build writes and every process with the same build inputs loads."""
    from torch.utils import cpp_extension  # loads setuptools: only the kernel's build paths need it

    name = _extension_name()
    return os.path.join(cpp_extension._get_build_directory(name, verbose=False), f"{name}.so")


def cpu_kernel_available() -> bool:
    """True when the kernel builds/loads here. Tries once per process; a failure logs one warning line."""
    if _module is not None:
        return True
    if _error is not None:
        return False
    if os.environ.get(DISABLE_ENV):  # opt-out, e.g. to force the torch backend
        return False
    try:
        load_cpu_kernel()
    except RuntimeError as err:
        log.warning("CPU attention kernel build failed (%s); %s", err, FALLBACK_NOTE)
        return False
    return True


def cpu_kernel_error() -> str | None:
    """Why the kernel is unavailable (None when it built or was not tried)."""
    if _error is None and _module is None and os.environ.get(DISABLE_ENV):
        return f"disabled by {DISABLE_ENV}"
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
