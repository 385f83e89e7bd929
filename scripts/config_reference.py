"""Writes docs/configuration.md from `splitserve serve`'s configuration dataclasses, so the page lists every
setting with its default and help text as the code has them.

    python3 -P scripts/config_reference.py --write    # regenerate the page
    python3 -P scripts/config_reference.py --check    # exit 1 if the committed page drifted
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from splitserve.api.serve_config import ENV_PREFIX, SECTIONS, TEST_HOOKS, USER_FLAGS
from splitserve.config_flags import default_text, env_name, flag_name

PAGE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"

INTRO = """# Configuration

`splitserve serve` reads every setting from four places, the first that has it winning:

1. its flag (`--page-size 32`);
2. its environment variable (`SPLITSERVE_PAGE_SIZE=32`; the name is the setting's in capitals);
3. the YAML file named by `--config FILE` (or `SPLITSERVE_CONFIG`), a mapping of setting names to values;
4. the default below.

`splitserve serve --help` lists the flags a user sets: the model, the role, ports, device, memory, parallelism,
the transfer endpoints and the drafters. The tuning knobs below are rarely needed; set them in the config file
(or the environment). They are accepted as flags too, and `splitserve serve --help-all` lists them.

```yaml
# engine.yaml: splitserve serve --model /models/llama --config engine.yaml
page_size: 32
max_waiting_requests: 4096
transfer_heartbeat_misses: 10
speculation_gate: false
drafter: [drafter-0:50061, drafter-1:50061]
```

Names take `_` or `-`. A key that is no setting, a value of the wrong type or outside a setting's choices
stops the engine with exit status 2 and a message naming the file and the key. `splitserve up` hands its
environment to the engines it starts, so `SPLITSERVE_CONFIG=engine.yaml splitserve up` configures them all;
in Kubernetes, mount the file and set `SPLITSERVE_CONFIG` in the role's `env`.
"""


def table(fields: list[dataclasses.Field]) -> list[str]:
    lines = ["| setting | default | what it does |", "| --- | --- | --- |"]
    for field in fields:
        help_text = " ".join(field.metadata.get("help", "").split()).replace("|", "\\|")
        choices = field.metadata.get("choices")
        if choices:
            help_text += f" (one of: {', '.join(f'`{c}`' for c in choices)})"
        lines.append(f"| `{field.name}` | `{default_text(field)}` | {help_text} |")
    return lines


def render() -> str:
    out = [INTRO, "## Flags `--help` lists", "",
           "Each is also a setting of the config file and an environment variable.", ""]
    for title, cls in SECTIONS:
        shown = [f for f in dataclasses.fields(cls) if f.init and f.name in USER_FLAGS]
        if shown:
            out += [f"### {title or 'engine'}", "", *table(shown), ""]
    out += ["## Tuning knobs", ""]
    for title, cls in SECTIONS:
        knobs = [f for f in dataclasses.fields(cls) if f.init and f.name not in USER_FLAGS | TEST_HOOKS]
        if knobs:
            out += [f"### {title or 'engine'}", "", *table(knobs), ""]
    hooks = [f for _, cls in SECTIONS for f in dataclasses.fields(cls) if f.name in TEST_HOOKS]
    out += ["## Test hooks", "",
            "Delays the tests inject to hold a transfer or an answer mid-way; environment variables only "
            "(no flag, not in the config file's use): leave them unset.", ""]
    out += [f"- `{env_name(ENV_PREFIX, f.name)}` (default `{default_text(f)}`): "
            f"{' '.join(f.metadata.get('help', '').split())}" for f in hooks]
    out += ["", f"Flags are the settings' names with `-` (`{flag_name('page_size')}`).", ""]
    return "\n".join(out)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true")
    mode.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        PAGE.write_text(text)
        return 0
    if PAGE.read_text() != text:
        print(f"{PAGE} drifted from the configuration dataclasses: run scripts/config_reference.py --write",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
