"""``model.dtype: auto`` (modeling/dtype_choice.py): bf16 where the hardware computes it, float32 elsewhere on CPU,
each choice with its reason; the config resolves it once for every pool, and ``magicserve serve`` / ``run`` say it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from controller.config import ConfigError, parse_config
from modeling.dtype_choice import DtypeChoice, choose_dtype, cpu_flags, cpu_native_bf16

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_DIR = os.path.join(REPO, "models", "stdlib-llama-15m")
AVX2 = {"fpu", "sse4_2", "avx", "avx2", "fma"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}


@pytest.mark.parametrize("flags,dtype,words", [
    (AVX2, "float32", "AVX2 without AVX-512"),
    (AVX512, "float32", "AVX-512 without AVX512-BF16"),
    (AVX512 | {"avx512_bf16"}, "bfloat16", "avx512_bf16"),
    (AVX512 | {"avx512_bf16", "amx_bf16", "amx_tile"}, "bfloat16", "avx512_bf16, amx_bf16"),
    ({"fp", "asimd", "bf16"}, "bfloat16", "bf16"),  # Arm with FEAT_BF16
    (set(), "float32", "no AVX512-BF16, AMX or BF16"),
])
def test_auto_on_cpu_follows_the_native_bf16_flags(flags, dtype, words):
    choice = choose_dtype("auto", "cpu", flags=flags, environ={})
    assert choice.dtype == dtype and words in choice.reason


def test_an_isa_cap_below_bf16_counts_as_no_native_bf16():
    flags = AVX512 | {"avx512_bf16"}
    capped = choose_dtype("auto", "cpu", flags=flags, environ={"ONEDNN_MAX_CPU_ISA": "avx512_core"})
    assert capped == DtypeChoice("float32", "ONEDNN_MAX_CPU_ISA=AVX512_CORE keeps oneDNN off this CPU's bf16 "
                                            "instructions")
    assert choose_dtype("auto", "cpu", flags=flags, environ={"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}).dtype == "bfloat16"
    aten = choose_dtype("auto", "cpu", flags=flags, environ={"ATEN_CPU_CAPABILITY": "avx2"})
    assert aten == DtypeChoice("float32", "ATEN_CPU_CAPABILITY=avx2 keeps torch's kernels off this CPU's bf16 "
                                          "instructions")
    assert choose_dtype("auto", "cpu", flags=flags, environ={"ATEN_CPU_CAPABILITY": "avx512"}).dtype == "bfloat16"


def test_an_explicit_dtype_is_taken_as_it_is():
    for name in ("float32", "bfloat16", "float16"):
        assert choose_dtype(name, "cpu", flags=AVX2, environ={}) == DtypeChoice(name, "set in the config")


def test_cpu_flags_reads_the_first_processor(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert cpu_flags(str(info)) == {"fpu", "avx2", "avx512f", "avx512_bf16"}
    assert cpu_flags(str(tmp_path / "missing")) == set()


def test_the_config_resolves_auto_once_for_every_pool():
    cfg = parse_config({"model": {"path": MODEL_DIR}})
    assert cfg.model.dtype == "auto"  # the default
    native, reason = cpu_native_bf16()
    assert cfg.dtype_choice == DtypeChoice("bfloat16" if native else "float32", reason)
    assert cfg.prefill.dtype == cfg.decode.dtype == cfg.colocated.dtype == cfg.dtype_choice.dtype
    gpu = parse_config({"model": {"path": MODEL_DIR}, "prefill": {"devices_per_instance": 1},
                        "decode": {"devices_per_instance": 1}})
    assert gpu.dtype_choice.dtype in ("bfloat16", "float16") and gpu.prefill.dtype == gpu.decode.dtype
    with pytest.raises(ConfigError, match=r"model.dtype: must be one of auto, float32, bfloat16, float16, got 'bf16'"):
        parse_config({"model": {"path": MODEL_DIR, "dtype": "bf16"}})


def test_magicserve_run_says_what_it_chose_and_why():
    env = {**os.environ, "PYTHONPATH": REPO, "ONEDNN_MAX_CPU_ISA": "AVX2", "MAGICSERVE_DISABLE_CPU_KERNEL": "1"}
    out = subprocess.run([sys.executable, "-m", "frontend.cli", "run", "--prompt", "import os", "--max-tokens", "4",
                          "--threads", "1"], env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    # this CPU's flags may have bf16 or not: the ISA cap rules it out either way
    assert "in float32 (" in out.stderr and ("ONEDNN_MAX_CPU_ISA=AVX2" in out.stderr or "no native bf16" in out.stderr)
    assert out.stdout.startswith("import os")
