"""A stand-in engine process for the cross-package tests: publishes EngineState
through the real agentic_common writer every 50 ms, like the vLLM plugin does.

    python tests/engine_publisher.py URI ENGINE_ID MODE

MODE "busy": 3 running requests decoding; "prefill": one 130k-token prefill
advancing by chunked-prefill steps (~400 tokens per 50 ms, so it lasts
minutes) on top of a single decode; "idle": nothing running. Runs until killed.
"""

from __future__ import annotations

import os
import sys
import time

from agentic_common import EngineState, open_writer

PREFILL_TOKENS = 130_000


def snapshot(engine_id: str, mode: str, seq: int, started: float) -> EngineState:
    now = time.time()
    running, decoding, decode_tokens, remaining = 0, 0, 0, 0
    if mode == "busy":
        running, decoding, decode_tokens = 3, 3, 3 * 6000
    elif mode == "prefill":
        remaining = max(1, PREFILL_TOKENS - int((now - started) * 8000))
        running, decoding, decode_tokens = 2, 1, 5000
    total, used = 20_000, 400 * running
    return EngineState(
        engine_id=engine_id,
        ts=now,
        seq=seq,
        pid=os.getpid(),
        num_running=running,
        num_waiting=0,
        gpu_blocks_total=total,
        gpu_blocks_free=total - used,
        gpu_kv_used_frac=used / total,
        pending_prefill_tokens=remaining,
        num_decoding=decoding,
        ongoing_decode_tokens=decode_tokens,
        num_prefilling=1 if remaining else 0,
        num_remote_prefill=0,
        last_step_ts=now,
        max_prefill_remaining=remaining,
        running_prefill_tokens=remaining,  # the one prefill has started
        queued_prefill_tokens=0,
        block_size=16,
    ).check()


def main() -> None:
    uri, engine_id, mode = sys.argv[1:4]
    writer = open_writer(uri)
    started = time.time()
    seq = 0
    print("ready", flush=True)
    while True:
        seq += 1
        writer.publish(snapshot(engine_id, mode, seq, started))
        time.sleep(0.05)


if __name__ == "__main__":
    main()
