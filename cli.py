"""The `splitserve` command: one entry point, a subcommand per job."""

from __future__ import annotations

import importlib
import logging
import sys

# Each subcommand lives in its own module, imported only when used, so that `splitserve
# operator` never imports torch and `splitserve serve` never imports kopf.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("splitserve.api.serve",
              "run one engine and its OpenAI API: --role unified|prefill|decode|encode|drafter"),
    "router": ("splitserve.router",
               "the OpenAI-compatible front door: routes to engines, retries, ejects and probes them"),
    "up": ("splitserve.launcher.up", "a whole deployment as local processes: engines, then the router in front"),
    "bench": ("splitserve.bench.command",
              "benchmarks: load a server or time the bare engine; figures as ratios (--help lists profiles)"),
    "kv-store": ("splitserve.launcher.kv_store", "a Mooncake Store master: the KV store tier shared by engines"),
    "operator": ("splitserve.operator.main", "the Kubernetes operator: reconciles ServingGroups into engine pods"),
}


def usage() -> str:
    lines = ["usage: splitserve <command> [flags]", "", "commands:"]
    lines += [f"  {name:<9} {text}" for name, (_, text) in SUBCOMMANDS.items()]
    lines += ["", "`splitserve <command> --help` lists a command's flags."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"splitserve: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    # httpx logs every request at INFO: too loud for the router and the launcher's health polls.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
