"""Router command step: `kvferry router --config router.yaml` loads the config and serves the app."""

from __future__ import annotations

import argparse
import logging
import sys

from kvferry.router.config import ConfigError, load_config, read_api_key


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvferry router", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="router.yaml (docs/contracts.md §2)")
    parser.add_argument("--host", help="override listen.host")
    parser.add_argument("--port", type=int, help="override listen.port")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_config(args.config)
        api_key = read_api_key(cfg.auth)
    except ConfigError as exc:
        print(f"kvferry router: bad config: {exc}", file=sys.stderr)
        return 2
    from aiohttp import web
    from kvferry.router.app import SERVE_OPTIONS, build_app

    host, port = args.host or cfg.host, args.port or cfg.port
    logging.getLogger(__name__).info(
        "router mode=%s policy=%s listening on %s:%d auth=%s", cfg.mode, cfg.policy, host, port,
        "on" if api_key else "off",
    )  # fmt: skip
    web.run_app(build_app(cfg, api_key), host=host, port=port, print=None, **SERVE_OPTIONS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
