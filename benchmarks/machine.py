"""What a result was measured on, and the model dtype that is fast there."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any


def fast_dtype() -> str:
    """bfloat16 where its matmuls are fast, else float32.

    vLLM's CPU linear layers use oneDNN, which has no bf16 matmul on CPUs
    without AVX-512 (BF16) or AMX; there vLLM falls back to a torch bf16
    matmul about 7x slower than oneDNN float32 (measured on a 2-core AVX2 EPYC).
    """
    import torch

    if torch.cuda.is_available():
        return "bfloat16"
    from vllm import _custom_ops as ops

    try:
        ops.create_onednn_mm(torch.zeros(64, 64, dtype=torch.bfloat16), 32)
    except (AttributeError, RuntimeError):
        return "float32"
    return "bfloat16"


BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_model() -> tuple[str, list[str]]:
    """The CPU's model name and which of the bf16 instruction sets it has."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine(), []
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines()
                 if line.startswith("model name")), platform.machine())
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines()
                  if line.startswith("flags")), [])
    return name, [f for f in BF16_CPU_FLAGS if f in flags]


HUGE_PAGES_FOR_TORCH = "THP_MEM_ALLOC_ENABLE"
"""torch's variable: its tensors on transparent huge pages when ``1``."""
HUGE_PAGES_FOR_MALLOC = "glibc.malloc.hugetlb=1"
"""glibc's tunable (in ``GLIBC_TUNABLES``): what libraries malloc on them."""
DAMON_ADMIN = Path("/sys/kernel/mm/damon/admin/kdamonds")


def idle_memory_pageout(admin: Path = DAMON_ADMIN) -> bool:
    """Whether the kernel pages out memory left idle (a running DAMON
    ``pageout`` scheme, as some VMs run to hand memory back to their host).
    Its filters decide what it may take: on our Zen 4 VM only file cache no
    process maps, never an engine's memory; its kdamond's CPU is what
    :func:`cpu_seconds` counts. Pause it for a run as root:
    ``echo off > <kdamond>/state``."""
    try:
        for kdamond in admin.iterdir():
            if not kdamond.name.isdigit() or (kdamond / "state").read_text().strip() != "on":
                continue
            if any(action.read_text().strip() == "pageout"
                   for action in kdamond.glob("contexts/*/schemes/*/action")):
                return True
    except OSError:
        pass
    return False


PROC = Path("/proc")
CPU_STAT_BUSY = (0, 1, 2, 5, 6)
"""user, nice, system, irq, softirq of ``/proc/stat``'s ``cpu`` line (guest
time is inside user); idle, iowait and steal are not busy."""
CPU_STAT_STEAL = 7


def cpu_seconds(proc: Path = PROC, admin: Path = DAMON_ADMIN,
                root_pid: int | None = None) -> dict[str, float]:
    """CPU seconds spent so far on the whole machine (``busy``), by this
    process (``root_pid``) and its descendants (``ours``: the engines), by
    DAMON's kdamond threads, and taken by the hypervisor (``steal``).
    Differences around a timed call tell whether something else ran on the
    cores meanwhile."""
    hertz = os.sysconf("SC_CLK_TCK")
    fields = (proc / "stat").read_text().splitlines()[0].split()[1:]
    ticks = [int(x) for x in fields]
    parents, used = {}, {}
    for stat in proc.glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue  # ended meanwhile
        rest = text[text.rindex(")") + 2:].split()
        pid = int(stat.parent.name)
        parents[pid] = int(rest[1])
        used[pid] = int(rest[11]) + int(rest[12])  # utime + stime
    ours = {os.getpid() if root_pid is None else root_pid}
    grown = True
    while grown:
        children = {pid for pid, parent in parents.items() if parent in ours} - ours
        ours |= children
        grown = bool(children)
    kdamonds = set()
    for pid_file in admin.glob("*/pid"):
        try:
            kdamonds.add(int(pid_file.read_text()))
        except (OSError, ValueError):
            pass
    return {
        "busy": sum(ticks[i] for i in CPU_STAT_BUSY) / hertz,
        "steal": ticks[CPU_STAT_STEAL] / hertz,
        "ours": sum(used.get(pid, 0) for pid in ours) / hertz,
        "kdamond": sum(used.get(pid, 0) for pid in kdamonds) / hertz,
    }


def others_cpu(before: dict[str, float], after: dict[str, float],
               wall_s: float) -> dict[str, float]:
    """Between two :func:`cpu_seconds`: CPU seconds per wall second (1.0 is
    one core) spent outside this process tree (``others``: kernel threads,
    agents, other programs), by kdamond among them, and stolen."""
    delta = {key: after[key] - before[key] for key in after}
    per_second = (lambda seconds: seconds / wall_s) if wall_s > 0 else (lambda seconds: 0.0)
    return {"others": per_second(max(delta["busy"] - delta["ours"], 0.0)),
            "kdamond": per_second(delta["kdamond"]),
            "steal": per_second(delta["steal"])}


def huge_page_share(pid: int, proc: Path = PROC) -> float | None:
    """Share of a process's anonymous memory (an engine worker's weights,
    KV cache, buffers) on transparent huge pages; None where unreadable.
    Below 1 where the kernel could not find 2 MiB of contiguous memory when
    it was touched: on a full 24 GiB VM the second engine of a run got 81%
    and read its weights slower (``results/goodput-grid-zen4-fragmented``)."""
    try:
        text = (proc / str(pid) / "smaps_rollup").read_text()
    except OSError:
        return None
    kib = {line.split(":")[0]: int(line.split()[1]) for line in text.splitlines()[1:]
           if line.endswith(" kB")}
    anonymous = kib.get("Anonymous", 0)
    return kib.get("AnonHugePages", 0) / anonymous if anonymous else None


VM_SYSCTL = Path("/proc/sys/vm")


def free_memory_for_huge_pages(sysctl: Path = VM_SYSCTL) -> bool:
    """Before an engine opens: drop the clean page cache (the last engine's
    model files) and compact memory, so its memory finds 2 MiB pages free.
    Needs root; whether it ran."""
    os.sync()
    try:
        (sysctl / "drop_caches").write_text("1")
        (sysctl / "compact_memory").write_text("1")
    except OSError:
        return False
    return True


def machine_info() -> dict[str, Any]:
    import torch
    import vllm

    name, bf16_flags = cpu_model()
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_model": name,
        "cpu_bf16_flags": bf16_flags,
        "cpu_count": os.cpu_count(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "vllm": vllm.__version__,
        "cuda": torch.cuda.is_available(),
        "huge_pages": (os.environ.get(HUGE_PAGES_FOR_TORCH) == "1"
                       and HUGE_PAGES_FOR_MALLOC in os.environ.get("GLIBC_TUNABLES", "")),
        "idle_memory_pageout": idle_memory_pageout(),
    }
