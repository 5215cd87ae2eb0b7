"""``python -m service``: serve Ferry with settings from FERRY_* variables (and ``.env``)."""

from __future__ import annotations

import argparse
import logging
import sys

import uvicorn
from pydantic import ValidationError

from service.settings import Settings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m service", description=__doc__)
    parser.add_argument("--host", help="bind address (FERRY_HOST, default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (FERRY_PORT, default 8000)")
    parser.add_argument("--data-dir", help="where the database, checkpoints and logs live (FERRY_DATA_DIR)")
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in {"host": args.host, "port": args.port, "data_dir": args.data_dir}.items() if v}
    try:
        settings = Settings(**overrides)
    except ValidationError as error:
        for problem in error.errors():
            print(f"ferry: {problem['msg'].removeprefix('Value error, ')}", file=sys.stderr)
        return 2
    if settings.executor == "local":
        from service.workers.devices import query_gpus, unlisted_devices_problem

        problem = unlisted_devices_problem(settings, query_gpus())
        if problem:
            print(f"ferry: {problem}", file=sys.stderr)
            return 2
    from service.queue.data_dir import holder_pid, in_use_message

    holder = holder_pid(settings.data_dir)
    if holder is not None:  # the lifespan would refuse too; say it before importing the app
        print(f"ferry: {in_use_message(settings.data_dir, holder)}", file=sys.stderr)
        return 2
    from service.api.app import create_app  # after the settings check: a refused start should be instant

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Event streams end by themselves on shutdown (sse-starlette); this bounds any other request still open.
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level="info",
        access_log=settings.access_log,
        timeout_graceful_shutdown=5,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
