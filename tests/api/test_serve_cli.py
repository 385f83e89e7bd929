"""`splitserve serve`'s command line: the user's flags in --help with their defaults, tuning knobs in
a config file, test hooks in the environment only, and clear errors on a bad file."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from splitserve.api.serve_config import TEST_HOOKS, USER_FLAGS, build_parser, parse_configs

FLAG = re.compile(r"^\s{2}(--[a-z0-9-]+)", re.M)


def help_text(*args: str) -> str:
    out = subprocess.run([sys.executable, "-P", "-m", "splitserve", "serve", *args], capture_output=True, text=True,
                         timeout=120, check=True)
    return out.stdout


def test_help_lists_at_most_40_flags_each_with_its_default() -> None:
    text = help_text("--help")
    flags = FLAG.findall(text)
    assert 20 <= len(flags) <= 40, flags
    options = text.split("options:", 1)[1]
    entries = re.split(r"\n(?=\s{2}-)", options)
    for entry in entries:
        if not entry.strip().startswith("-"):
            continue
        name = entry.split()[0].rstrip(",")
        if name in ("-h", "--help-all", "--config"):
            continue
        assert "default" in entry, f"{name} shows no default:\n{entry}"


def test_help_all_lists_the_tuning_knobs_and_help_has_no_double_negatives() -> None:
    short, full = FLAG.findall(help_text("--help")), FLAG.findall(help_text("--help-all"))
    assert "--gil-switch-interval-ms" in full and "--gil-switch-interval-ms" not in short
    assert not [f for f in full if f.startswith(("--no-disable", "--no-no-", "--no-skip"))]
    assert not {"--embedding-write-pause-s", "--encode-answer-delay-s"} & set(full)


def test_test_hooks_are_not_flags_but_the_environment_sets_them() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--embedding-write-pause-s", "1"])
    configs = parse_configs([], environ={"SPLITSERVE_EMBEDDING_WRITE_PAUSE_S": "0.5"})
    assert configs.epd.embedding_write_pause_s == 0.5
    assert TEST_HOOKS.isdisjoint(USER_FLAGS)


def test_config_file_sets_tuning_knobs_and_flags_and_env_win(tmp_path: Path) -> None:
    path = tmp_path / "engine.yaml"
    path.write_text("page-size: 32\ngil_switch_interval_ms: 2.5\ntransfer_heartbeat_misses: 9\n"
                    "speculation_gate: false\ndrafter: [a:1, b:2]\n")
    configs = parse_configs(["--config", str(path)], environ={})
    assert configs.engine.page_size == 32 and configs.engine.gil_switch_interval_ms == 2.5
    assert configs.transfer.transfer_heartbeat_misses == 9
    assert configs.spec.speculation_gate is False and configs.spec.drafter == ["a:1", "b:2"]
    assert parse_configs(["--config", str(path), "--page-size", "8"], environ={}).engine.page_size == 8
    assert parse_configs(["--config", str(path)], environ={"SPLITSERVE_PAGE_SIZE": "64"}).engine.page_size == 64
    assert parse_configs([], environ={"SPLITSERVE_CONFIG": str(path)}).engine.page_size == 32


@pytest.mark.parametrize(("text", "message"), [
    ("page_sise: 32\n", "unknown setting 'page_sise' (did you mean 'page_size'?)"),
    ("page_size: many\n", "expected int, got 'many'"),
    ("- page_size\n", "expected a mapping of settings"),
    ("page_size: [1\n", "not valid YAML"),
    ("role: sideways\n", "'sideways' is not one of"),
])
def test_a_bad_config_file_exits_2_naming_the_file_and_the_setting(tmp_path: Path, text: str, message: str,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(SystemExit) as exit_info:
        parse_configs(["--config", str(path)], environ={})
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert str(path) in err or "config file" in err
    assert message in err


def test_a_missing_config_file_is_an_error_not_a_silent_default(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_configs(["--config", str(tmp_path / "absent.yaml")], environ={})
    assert "cannot read it" in capsys.readouterr().err
