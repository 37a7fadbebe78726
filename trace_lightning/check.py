"""`python -m trace_lightning.check <Hydra overrides>`: the train config's environment, checked by
`envs.check.check_environment` before a long run. For example

    python -m trace_lightning.check env=capitals 'hydra.searchpath=[file://examples/capitals/conf]'

Exit status 0 when it passes, 1 when it has problems (each printed on one line). The command line lives
here, not in `envs/check.py`, because it reads the config, and `envs/` imports nothing from the package
outside itself (tests/test_architecture.py).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from trace_lightning import config
from trace_lightning.envs.check import check_environment, visible


def main(argv: Sequence[str] | None = None) -> int:
    """Compose `conf/train.yaml` with `argv` (default: the command line), build its `env` and check it;
    print each problem and a summary line, and return the exit status."""
    overrides = list(sys.argv[1:] if argv is None else argv)
    config.register()
    with initialize_config_dir(config_dir=str(config.conf_dir()), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    env = instantiate(cfg.env)
    problems = check_environment(env)
    for p in problems:
        print(f"- {visible(p)}")
    name = visible(str(getattr(env, "name", type(env).__name__)))
    print(f"env={name}: {'OK' if not problems else f'{len(problems)} problem(s)'}")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
