"""The shipped configs: every group option instantiates, and every key an error message names exists."""

import ast
import inspect
import re
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import get_method, instantiate
from omegaconf import OmegaConf

from trace_lightning import config
from trace_lightning.allocation import TreeAllocator
from trace_lightning.budget import Budget

CONF = Path(__file__).resolve().parents[1] / "conf"
GROUP_OPTIONS = [
    (group.name, option.stem)
    for group in sorted(CONF.iterdir())
    if group.is_dir() and group.name not in ("experiment", "debug", "__pycache__")
    for option in sorted(group.glob("*.yaml"))
]


def compose_with(tmp_path, *overrides):
    config.register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(config.conf_dir()), version_base="1.3"):
        cfg = compose("train", overrides=[f"output_root={tmp_path}", f"run_dir={tmp_path}/run", *overrides])
    GlobalHydra.instance().clear()
    return cfg


@pytest.mark.parametrize("path", sorted((CONF / "allocator").glob("*.yaml")), ids=lambda p: p.stem)
def test_allocator_configs_instantiate_and_spend_the_budget(path):
    allocator = instantiate(OmegaConf.load(path))
    assert isinstance(allocator, TreeAllocator)
    assert allocator.name == path.stem
    counts = allocator.allocate_roots(np.linspace(0, 1, 64), Budget(48), np.random.default_rng(0))
    assert counts.sum() * (1 + allocator.expansion) == 48


# ------------------------------------------------------------------ keys named by error messages
# Every config key an error message names is a real key of the composed config.
#
# A message such as "data.pool_size=40 exceeds the 30 tasks" tells the user what to override; a key that
# does not exist (a typo, a renamed group, a key of another component) sends them to a dead end, or to
# Hydra's `+key=` which adds a setting nothing reads. This walks the string parts of every `raise` (and
# every warning) in the package, takes each `a.b=` it names, and resolves it against the union of the
# configs composed with every option of every group.


PACKAGE = Path(config.__file__).parent
KEY = re.compile(r"(?<![\w.\-/])([a-z][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)+)=")
WARNINGS = {"warn", "rank_zero_warn"}


def message_keys() -> dict[str, set[str]]:
    """key -> the files whose error or warning messages name it."""
    found: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            is_warning = (
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", getattr(node.func, "id", None)) in WARNINGS
            )
            if not (isinstance(node, ast.Raise) or is_warning):
                continue
            for part in ast.walk(node):
                if isinstance(part, ast.Constant) and isinstance(part.value, str):
                    for key in KEY.findall(part.value):
                        found.setdefault(key, set()).add(str(path.relative_to(PACKAGE.parent)))
    return found


def all_keys(cfg) -> set[str]:
    """Every dotted key of a composed config, walked here (not by config.setting_keys, which the CLI
    check uses), so the oracle does not lean on the package's own walker."""
    out, stack = set(), [("", OmegaConf.to_container(cfg, resolve=False))]
    while stack:
        prefix, node = stack.pop()
        for key, value in node.items() if isinstance(node, dict) else ():
            out.add(f"{prefix}{key}")
            stack.append((f"{prefix}{key}.", value))
    return out


@pytest.fixture(scope="module")
def known_keys() -> set[str]:
    """Keys of the default config and of every group option (a key may belong to one option only)."""
    config.register()
    groups = {
        p.name: sorted(f.stem for f in p.glob("*.yaml")) for p in config.conf_dir().iterdir() if p.is_dir()
    }
    keys: set[str] = set()
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(config.conf_dir()), version_base="1.3"):
        keys |= all_keys(compose("train"))
        for group, options in groups.items():
            for option in options:
                keys |= all_keys(compose("train", overrides=[f"{group}={option}"]))
    GlobalHydra.instance().clear()
    return keys


def test_messages_name_keys_at_all():
    keys = message_keys()
    assert {"budget.leaves", "data.pool_size", "loss.clip_low", "sampling.temperature"} <= set(keys)


def test_every_key_a_message_names_exists(known_keys):
    unknown = {key: files for key, files in message_keys().items() if key not in known_keys}
    assert not unknown, f"messages name keys the config does not have: {unknown}"


def test_the_walk_catches_an_unknown_key(known_keys):
    """The oracle itself can fail: a misspelt key is not among the known ones."""
    assert "budget.leavs" not in known_keys and "budget.leaves" in known_keys


# Arguments the caller passes when it builds the component (the engine's policy and tokenizer), and the
# auto engine's factories (tests swap them), are not settings.
INJECTED = {("engine", "model"), ("engine", "tokenizer"), ("engine", "vllm"), ("engine", "hf")}


def component_nodes(cfg, group):
    node = cfg[group]
    if node is None:
        return {}
    if group == "callbacks":
        return {f"callbacks.{k}": v for k, v in node.items() if v is not None and "_target_" in v}
    return {group: node} if node is not None and "_target_" in node else {}


@pytest.mark.parametrize(("group", "option"), GROUP_OPTIONS, ids=[f"{g}={o}" for g, o in GROUP_OPTIONS])
def test_every_component_group_lists_its_constructors_arguments(tmp_path, group, option):
    """The lightning-hydra-template rule: every argument of one of our constructors is
    a key of its group, so each can be overridden (and named in an error) without Hydra's `+`."""
    cfg = compose_with(tmp_path, f"{group}={option}")
    for key, node in component_nodes(cfg, group).items():
        if not node._target_.startswith("trace_lightning."):
            continue  # torch's optimizers, Lightning's Trainer: their own documented signatures
        params = inspect.signature(get_method(node._target_)).parameters.values()
        wanted = [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        keys = set(node.keys())  # not `p in node`: that is False for a mandatory `???` value
        missing = [p for p in wanted if p not in keys and (group, p) not in INJECTED]
        assert not missing, f"{key} ({node._target_}) lacks {missing}: add them to conf/{group}/{option}.yaml"
