"""Old path of `trace_lightning.envs.sandbox.jail` (the jail moved into envs/sandbox/, issue 25): this name
is that very module, so code and configs that name it keep working."""

import sys

from trace_lightning.envs.sandbox import jail

sys.modules[__name__] = jail
