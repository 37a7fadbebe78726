"""The python tool's jail: model-written programs run in bubblewrap, in a cgroup per call.

- `limits.py`: `SandboxLimits` (config group `env.sandbox`) and `SandboxResult`;
- `run.py`: `run_python`, `check_sandbox` (fail closed at start-up), `format_observation`;
- `jail.py`: bwrap's command line and the seccomp filter; `mounts.py`: what the jail shows of the host's
  /proc and /usr, and the scratch's file cap; `cgroup.py`: the call's cgroup (v1 or v2);
  `output.py`: stdout and stderr through bounded pipes; `worker.py`: the launcher that runs in the jail.

`trace_lightning.envs.sandbox.SandboxLimits` is a Hydra `_target_` (part of checkpoint fingerprints) and
keeps that path; the old `trace_lightning.envs.jail` and `envs.sandbox_worker` paths resolve to this
package's `jail` and `worker` in a checkpoint's fingerprint (`checkpoints.fingerprint.MOVED`).
"""

from trace_lightning.envs.sandbox.jail import JailUnavailableError
from trace_lightning.envs.sandbox.limits import JAILS, UNSAFE_NO_JAIL, SandboxLimits, SandboxResult
from trace_lightning.envs.sandbox.run import check_sandbox, format_observation, run_python

__all__ = [
    "JAILS",
    "UNSAFE_NO_JAIL",
    "JailUnavailableError",
    "SandboxLimits",
    "SandboxResult",
    "check_sandbox",
    "format_observation",
    "run_python",
]
