"""What this machine's CPU is, read from /proc/cpuinfo (Linux) in one place: its feature flags as
oneDNN may use them (strategy: the precision `auto` picks, oneDNN on or off), its cores and clock
(core.flops: the peak behind MFU), its name (benchmark rows).

Plain Python, no TensorFlow: `import tfdp` decides TF_ENABLE_ONEDNN_OPTS from the flags before
TensorFlow loads.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Sequence

CPUINFO = "/proc/cpuinfo"
MAX_FREQ = "/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq"

# oneDNN's dispatch cap (ONEDNN_MAX_CPU_ISA, e.g. AVX2 to imitate an AVX2-only CPU) hides
# instructions from every kernel TF runs; the flags it hides, by the cap's name.
_AVX512_AND_AMX = ("avx512", "amx")
ONEDNN_ISA_CAP_HIDES = {
    **{isa: _AVX512_AND_AMX for isa in ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2")},
    "AVX512_CORE": ("avx512_bf16", "avx512_fp16", "amx"),
    "AVX512_CORE_VNNI": ("avx512_bf16", "avx512_fp16", "amx"),
    "AVX512_CORE_BF16": ("avx512_fp16", "amx"), "AVX512_CORE_FP16": ("amx",),
    "AVX10_1_512": ("amx",)}


@dataclasses.dataclass(frozen=True)
class CpuFacts:
  vendor: str  # GenuineIntel, AuthenticAMD
  family: int
  model_name: str
  flags: frozenset  # as oneDNN may use them (under ONEDNN_MAX_CPU_ISA where set)
  cores: int  # physical cores this process may run on
  mhz: float  # the rated maximum where the kernel says it, else what /proc/cpuinfo reports


def onednn_capped(flags: Sequence[str], environ=None) -> list[str]:
  """The flags oneDNN may use under ONEDNN_MAX_CPU_ISA (or its old name DNNL_MAX_CPU_ISA)."""
  environ = os.environ if environ is None else environ
  cap = (environ.get("ONEDNN_MAX_CPU_ISA") or environ.get("DNNL_MAX_CPU_ISA") or "").upper()
  hidden = ONEDNN_ISA_CAP_HIDES.get(cap, ())
  return [flag for flag in flags if not flag.startswith(hidden)] if hidden else list(flags)


def first_processor(cpuinfo_path: str = CPUINFO) -> dict[str, str]:
  """The first processor's entry of /proc/cpuinfo as {field: value}; {} where it is absent."""
  fields = {}
  try:
    with open(cpuinfo_path, encoding="utf-8", errors="replace") as f:
      for line in f:
        if not line.strip():
          break
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
  except OSError:
    pass
  return fields


def cpu_flags(cpuinfo_path: str = CPUINFO, environ=None) -> list[str]:
  """The CPU's feature flags that oneDNN may use; [] where /proc/cpuinfo is absent."""
  return onednn_capped(first_processor(cpuinfo_path).get("flags", "").split(), environ)


def cpu_facts(cpuinfo_path: str = CPUINFO, max_freq_path: str = MAX_FREQ,
              usable_cpus: int | None = None, environ=None) -> CpuFacts:
  """The first processor's entry, and the process's CPU affinity (logical CPUs, halved on an
  SMT machine: siblings share one core's FMA pipes)."""
  fields = first_processor(cpuinfo_path)
  logical = usable_cpus or len(os.sched_getaffinity(0))
  siblings, per_package = int(fields.get("siblings", 1)), int(fields.get("cpu cores", 1))
  mhz = float(fields.get("cpu MHz", 0.0))
  if os.path.exists(max_freq_path):
    with open(max_freq_path, encoding="utf-8") as f:
      mhz = int(f.read().strip()) / 1000.0  # kHz
  return CpuFacts(fields.get("vendor_id", ""), int(fields.get("cpu family", 0)),
                  fields.get("model name", ""),
                  frozenset(onednn_capped(fields.get("flags", "").split(), environ)),
                  max(1, logical * per_package // max(siblings, 1)), mhz)
