"""Old path of `trace_lightning.envs.sandbox.worker` (the jail moved into envs/sandbox/, issue 25): this
name is that very module, so code and configs that name it keep working."""

import sys

from trace_lightning.envs.sandbox import worker

sys.modules[__name__] = worker
