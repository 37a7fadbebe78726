"""BFCL v4 multi-turn function calling (`env=bfcl`): the environment (`env.py`), the entries and
their calls (`data.py`), the simulated APIs replayed per state (`world.py`), BFCL's per-turn checks
(`checker.py`) and the system prompt with the function docs (`prompt.py`)."""

from trace_lightning.envs.bfcl.env import BFCLEnv

__all__ = ["BFCLEnv"]
