"""Shared test helpers (plain functions; fixtures live in conftest.py)."""

import lightning as L


def quiet_trainer(**overrides) -> L.Trainer:
    """A CPU Trainer for one-iteration-per-epoch tests: no logger, checkpoints, bars or summary."""
    kwargs = {
        "max_epochs": 1,
        "reload_dataloaders_every_n_epochs": 1,
        "accelerator": "cpu",
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    return L.Trainer(**{**kwargs, **overrides})
