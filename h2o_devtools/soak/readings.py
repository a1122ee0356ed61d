"""Server-side readings taken around a soak (client process, reading the server from outside):
``scrape`` (``/metrics`` as ``{name: value}``, labels summed away), ``wait_idle`` (polls until
the engine holds no KV block and runs nothing) and ``group_rss`` (resident memory summed over a
process group, from ``/proc``)."""
from __future__ import annotations

import os
import time

import requests


def scrape(base_url: str) -> dict[str, float]:
    """``/metrics`` as {sample name: value}, summed over label sets (one engine here); samples
    with a ``finished_reason`` label also under ``name{finished_reason="..."}``."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    text = requests.get(f"{base_url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            keys = [sample.name]
            if "finished_reason" in sample.labels:
                keys.append(f'{sample.name}{{finished_reason="{sample.labels["finished_reason"]}"}}')
            for key in keys:
                values[key] = values.get(key, 0.0) + sample.value
    return values


#: Gauges that are 0 when the engine holds nothing (stock vLLM: the ``vllm:`` ones).
IDLE_GAUGES = ("vllm:kv_cache_usage_perc", "h2o_vllm:live_kv_tokens", "vllm:num_requests_running",
               "vllm:num_requests_waiting")
STOCK_IDLE_GAUGES = tuple(name for name in IDLE_GAUGES if name.startswith("vllm:"))


def wait_idle(base_url: str, timeout_s: float = 10.0, gauges=IDLE_GAUGES) -> dict[str, float]:
    """Poll ``/metrics`` until every one of ``gauges`` is 0 (or the timeout); returns the last
    scrape. vLLM updates its gauges at each engine step, H2O's writers flush every 0.2 s."""
    deadline = time.monotonic() + timeout_s
    while True:
        values = scrape(base_url)
        if all(values.get(name) == 0 for name in gauges) or time.monotonic() > deadline:
            return values
        time.sleep(0.2)


def group_rss(pgid: int) -> int:
    """Resident bytes summed over the processes of process group ``pgid`` (Linux /proc)."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            # Fields after the parenthesised command: state ppid pgrp ...
            if int(stat.rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            with open(f"/proc/{entry}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            continue  # the process ended meanwhile
    return total
