"""Every `python -m trace_lightning.{trainer,warmstart,evaluate}` command the README, the docs, the
Dockerfile and the shipped configs print composes against today's config (a Dockerfile once still said
`trainer.strategy=fsdp` after the group became `trainer=fsdp2`). Composing checks every
override's key and group option; nothing is built or run."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from trace_lightning import config

ROOT = Path(__file__).parents[1]
SOURCES = [ROOT / "README.md", ROOT / "Dockerfile", *sorted((ROOT / "docs").glob("*.md"))]
SOURCES += sorted((ROOT / "conf").rglob("*.yaml"))
CONFIG_OF = {"trainer": "train", "warmstart": "warmstart", "evaluate": "evaluate"}
COMMAND = re.compile(r"-m trace_lightning\.(trainer|warmstart|evaluate)\b(.*)")


def _joined(text: str) -> list[str]:
    """Lines with shell continuations joined (a Dockerfile comment's continuation starts with `#`)."""
    return re.sub(r"\\\n[ \t]*#?[ \t]*", " ", text).splitlines()


def _overrides(rest: str) -> list[str] | None:
    """The Hydra overrides of one command line, up to a comment, a closing backtick or a placeholder
    for more; the first value of a `-m` sweep. None when the line holds no override (prose)."""
    out, sweep, words = [], False, re.sub(r"<[^>]*>", "x", rest).split()
    for i, word in enumerate(words):
        if word.startswith(("#", "...", ";", "&&", "|", "(")) or word.startswith("`"):
            break
        end = "`" in word
        word = word.split("`")[0].rstrip(",;.)").strip("'\"")  # shell quotes around an override
        if word == "-m":
            sweep = True
        elif word.startswith("--") or (i and words[i - 1] == "--cfg"):
            pass
        elif "=" in word:
            key, value = word.split("=", 1)
            if sweep and "," in value and not value.startswith("["):
                value = value.split(",")[0]
            out.append(f"{key}={value}")
        else:
            break
        if end:
            break
    return out or None


def _commands() -> list[tuple[str, str, list[str]]]:
    found = []
    for path in SOURCES:
        for n, line in enumerate(_joined(path.read_text()), 1):
            for match in COMMAND.finditer(line):
                overrides = _overrides(match.group(2))
                if overrides is not None:
                    found.append((f"{path.relative_to(ROOT)}:{n}", match.group(1), overrides))
    docker = (ROOT / "Dockerfile").read_text()
    cmd = re.search(r"^CMD (\[.*\])$", docker, re.M)
    assert cmd is not None
    found.append(("Dockerfile:CMD", "trainer", json.loads(cmd.group(1))))
    return found


COMMANDS = _commands()


def test_the_scan_finds_the_commands_it_is_meant_to_check():
    """A control for the parser: a few commands known to be printed, among many."""
    assert len(COMMANDS) >= 20
    flat = {(module, " ".join(o)) for _, module, o in COMMANDS}
    assert ("trainer", "trainer=fsdp2 debug=fast") in flat
    assert ("trainer", "trainer=gpu engine=vllm") in flat  # the Docker image's CMD


def test_a_stale_override_fails_to_compose():
    """The check can fail: a trainer group option that does not exist (the group is `fsdp2`)."""
    config.register()
    conf = initialize_config_dir(config_dir=str(config.conf_dir()), version_base="1.3")
    with conf, pytest.raises(Exception, match="fsdp"):
        compose("train", ["trainer=fsdp"])


@pytest.mark.parametrize(("where", "module", "overrides"), COMMANDS, ids=[c[0] for c in COMMANDS])
def test_every_printed_command_composes(where, module, overrides):
    config.register()
    with initialize_config_dir(config_dir=str(config.conf_dir()), version_base="1.3"):
        compose(CONFIG_OF[module], overrides)
