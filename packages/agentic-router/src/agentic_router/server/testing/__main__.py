"""Run fake engines in their own process (benchmarks, manual tries).

    python -m agentic_router.server.testing --flavor vllm --count 2

prints one JSON line `{"urls": [...]}` once listening, then serves until killed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys

from agentic_router.server.testing._fake_engine import FakeEngine


async def _main(args: argparse.Namespace) -> None:
    engines = [
        FakeEngine(
            args.flavor,
            output_tokens=args.output_tokens,
            engine_id=f"engine_{i}",
            models=args.model or (),
            strict_models=bool(args.model),
        )
        for i in range(args.count)
    ]
    for engine in engines:
        await engine.start()
    print(json.dumps({"urls": [e.url for e in engines]}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for engine in engines:
        await engine.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agentic_router.server.testing")
    parser.add_argument("--flavor", choices=("vllm", "sglang"), default="vllm")
    parser.add_argument("--count", type=int, default=1)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument(
        "--model",
        action="append",
        help="a model the engines serve, repeatable (default: tiny, any name accepted); "
        "given, a request for another model is a 404",
    )
    asyncio.run(_main(parser.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
