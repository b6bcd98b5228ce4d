"""The `meterserve` command: `serve` (the HTTP server), `bench`, `loadtest`.

bench and loadtest live in their own packages and receive the remaining arguments as is.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

USAGE = """usage: meterserve <command> [options]

commands:
  serve      serve a model over an OpenAI-compatible HTTP API (meterserve serve --help)
  bench      offline engine benchmark (meterserve bench --help)
  loadtest   load-test an OpenAI-compatible server (meterserve loadtest --help)
"""


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "serve":
        return serve(rest)
    if command == "bench":
        from engine.bench import main as bench_main

        return bench_main(rest)
    if command == "loadtest":
        from loadtest.runner import main as loadtest_main

        return loadtest_main(rest)
    if command in ("--version", "version"):
        from server.routes.version import package_version

        print(package_version())
        return 0
    print(f"meterserve: unknown command {command!r}\n\n{USAGE}", end="", file=sys.stderr)
    return 2


def serve(argv: Sequence[str]) -> int:
    from engine.freed_memory import share_one_arena

    share_one_arena()  # before any thread starts: the engine thread's steps reuse freed memory
    import uvicorn

    from server.app import create_app
    from server.http.draining_server import DrainingServer
    from server.settings import Settings, SettingsError

    try:
        settings = Settings.from_args(argv)
    except SettingsError as exc:
        print(f"meterserve serve: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=settings.access_log,
        lifespan="on",
        timeout_graceful_shutdown=5,
        timeout_keep_alive=5,
    )
    server = DrainingServer(config, app.state.engine_client, settings.drain_grace_period)
    server.run()
    if not server.started and server.exit_code == 0:
        return 3  # the start-up failed (uvicorn logged why; e.g. --metrics-port was taken)
    return server.exit_code


if __name__ == "__main__":
    sys.exit(main())
