from pathlib import Path

import numpy as np
import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from trace_lightning.allocation import Budget, TreeAllocator

CONF = Path(__file__).resolve().parents[1] / "conf"


@pytest.mark.parametrize("path", sorted((CONF / "allocator").glob("*.yaml")), ids=lambda p: p.stem)
def test_allocator_configs_instantiate_and_spend_the_budget(path):
    allocator = instantiate(OmegaConf.load(path))
    assert isinstance(allocator, TreeAllocator)
    assert allocator.name == path.stem
    counts = allocator.allocate_roots(np.linspace(0, 1, 64), Budget(48), np.random.default_rng(0))
    assert counts.sum() * (1 + allocator.expansion) == 48
