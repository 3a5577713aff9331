"""The router process's own metrics, under the names every Prometheus client
library uses (so the usual dashboards and alerts apply): read from /proc/self
when /metrics is scraped (Linux; elsewhere only what the standard library
knows: CPU time and the start time).

A few small procfs reads per scrape; nothing on the request path.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Final

from agentic_router.server._exposition import Family

_PROC: Final = Path("/proc/self")


def _clock_ticks() -> int:
    try:
        return os.sysconf("SC_CLK_TCK")
    except (ValueError, OSError, AttributeError):
        return 100


def _page_size() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 4096


def _boot_time() -> float | None:
    try:
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("btime "):
                return float(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _start_time() -> float:
    """Seconds since the epoch when this process started: from /proc (its start in
    clock ticks after boot), else when this module was imported."""
    boot = _boot_time()
    try:
        stat = (_PROC / "stat").read_text()
        # fields after the command name (which may hold spaces and parentheses)
        fields = stat[stat.rindex(")") + 2 :].split()
        if boot is not None:
            return boot + int(fields[19]) / _clock_ticks()
    except (OSError, ValueError, IndexError):
        pass
    return _IMPORTED


_IMPORTED: Final = time.time()
_STARTED: Final = _start_time()


def _max_fds() -> float | None:
    try:
        for line in (_PROC / "limits").read_text().splitlines():
            if line.startswith("Max open files"):
                soft = line.split()[3]
                return None if soft == "unlimited" else float(soft)
    except (OSError, ValueError, IndexError):
        pass
    return None


def process_families() -> list[Family]:
    """process_cpu_seconds_total, process_start_time_seconds and, on Linux,
    process_resident_memory_bytes, process_virtual_memory_bytes, process_open_fds,
    process_max_fds."""
    times = os.times()
    cpu = Family("process_cpu_seconds_total", "counter", "user and system CPU time spent")
    cpu.set(value=round(times.user + times.system, 3))
    start = Family(
        "process_start_time_seconds", "gauge", "start time of the process since the epoch"
    )
    start.set(value=round(_STARTED, 3))
    out = [cpu, start]
    try:
        pages = (_PROC / "statm").read_text().split()
        virtual, resident = int(pages[0]), int(pages[1])
    except (OSError, ValueError, IndexError):
        pass
    else:
        rss = Family("process_resident_memory_bytes", "gauge", "resident memory size in bytes")
        rss.set(value=float(resident * _page_size()))
        vms = Family("process_virtual_memory_bytes", "gauge", "virtual memory size in bytes")
        vms.set(value=float(virtual * _page_size()))
        out += [rss, vms]
    try:
        open_fds = len(os.listdir(_PROC / "fd"))
    except OSError:
        pass
    else:
        fds = Family("process_open_fds", "gauge", "open file descriptors")
        fds.set(value=float(open_fds))
        out.append(fds)
        limit = _max_fds()
        if limit is not None:
            most = Family("process_max_fds", "gauge", "maximum number of open file descriptors")
            most.set(value=limit)
            out.append(most)
    return out
