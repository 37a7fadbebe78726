"""Whether a checkpoint can be resumed from: `validate_checkpoint` and the checks against this run.

Before use (`validate_checkpoint`), each failure a `CheckpointError` whose `reason` and message name
the problem: the SHA-256 digest written beside the file, the pickle scan (`scan.refused_global`), the
Lightning keys, and that no tensor or float in any state (weights, optimizers, the DataModule's prior,
selection and predictor refit) is NaN or inf. A sharded folder goes through
`shards.validate_folder`, the same checks file by file. `check_resumable` then compares the config
fingerprint (model, adapter, allocator, env, predictor), and `check_shapes` the weight shapes, with
this run's, and `check_strategy` that a sharded folder meets the strategy and process count that
wrote it. `newest_valid` (`ckpt_path=last`) considers only the files the folder's manifest
(`files.Manifest`) lists as plain names in the folder, and only those written by the manifest's run,
so another run's file is never chosen.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

import torch

from trace_lightning.checkpoints.files import Manifest, digest_path
from trace_lightning.checkpoints.fingerprint import same_group
from trace_lightning.checkpoints.scan import REQUIRED_KEYS, CheckpointError, load_archive, refuse_non_finite
from trace_lightning.checkpoints.shards import VERIFIED, validate_folder

log = logging.getLogger(__name__)

ALLOW_CHANGE_KEY = "checkpoints.allow_config_change"


def validate_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load a checkpoint on the CPU after every check above, or raise `CheckpointError` naming the file.

    The file is read once: the digest, the pickle scan and `torch.load` all see the same bytes in
    memory, so a file rewritten between the check and the load cannot slip in."""
    path = Path(path)
    if path.is_dir():  # a sharded checkpoint (trainer=fsdp2): the same checks, file by file
        return validate_folder(path)
    if not path.is_file():
        raise CheckpointError(
            "missing", f"checkpoint {path} does not exist; pass ckpt_path=<a .ckpt file> or ckpt_path=last"
        )
    data = path.read_bytes()
    _check_digest(path, data)
    ckpt = load_archive(data, path)
    missing = [k for k in REQUIRED_KEYS if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise CheckpointError(
            "not_lightning", f"checkpoint {path} is not a Lightning checkpoint (missing {missing})"
        )
    refuse_non_finite(path, ckpt)
    return dict(ckpt)


def _check_digest(path: Path, data: bytes) -> None:
    digest = digest_path(path.resolve())
    if not digest.is_file():
        raise CheckpointError(
            "no_digest",
            f"checkpoint {path} has no digest {digest.name} beside it, so it was not written by this "
            "trainer (or its save was cut short); resume from another file (ckpt_path=last), or, for a "
            f"file you trust, write one: sha256sum {path} | cut -d' ' -f1 > {digest}",
        )
    if digest.read_text().strip() != hashlib.sha256(data).hexdigest():
        raise CheckpointError(
            "digest_mismatch",
            f"checkpoint {path} does not match its SHA-256 digest {digest.name}: its bytes changed after "
            "it was written (disk corruption or tampering); resume from another file (ckpt_path=last)",
        )


def check_resumable(
    path: str | Path,
    ckpt: dict[str, Any],
    fingerprint: dict[str, str],
    allow_config_change: bool = False,
) -> None:
    """The checkpoint was written by a run of this config (unless `allow_config_change`); settings added
    since, at their defaults, and moved `_target_` paths do not count (fingerprint.py)."""
    stored = (ckpt.get("trace_run") or {}).get("fingerprint")
    if allow_config_change:
        return
    if stored is None:
        raise CheckpointError(
            "config_mismatch",
            f"checkpoint {path} has no config fingerprint (written by an older trainer); "
            f"set {ALLOW_CHANGE_KEY}=true to resume from it anyway",
        )
    groups = sorted(fingerprint.keys() | stored.keys())
    differ = [k for k in groups if not same_group(stored.get(k), fingerprint.get(k))]
    if not differ and any(stored.get(k) != fingerprint.get(k) for k in groups):
        log.info("checkpoint %s predates settings now at their defaults, or moved modules: same config", path)
    if differ:
        details = "; ".join(f"{k}: checkpoint {stored.get(k)} vs now {fingerprint.get(k)}" for k in differ)
        raise CheckpointError(
            "config_mismatch",
            f"checkpoint {path} was written with another {', '.join(differ)} config ({details}); "
            f"resume with the same config, or set {ALLOW_CHANGE_KEY}=true to resume anyway",
        )


def check_shapes(
    path: str | Path,
    ckpt: dict[str, Any],
    state: dict[str, torch.Tensor],
    left_out: frozenset[str] = frozenset(),
) -> None:
    """Weights of another model size fail here, naming the tensors, rather than deep inside `fit`.
    `left_out`: the frozen weights a checkpoint may lack (frozen.py: checked by digest instead)."""
    saved = ckpt["state_dict"]
    wrong = [
        f"{k} {tuple(saved[k].shape)} vs {tuple(v.shape)}"
        for k, v in state.items()
        if k in saved and saved[k].shape != v.shape
    ]
    absent = sorted(state.keys() - saved.keys() - left_out)
    unknown = sorted(saved.keys() - state.keys())  # a non-strict (LoRA) load would ignore them
    if wrong or absent or unknown:
        raise CheckpointError(
            "shape_mismatch",
            f"checkpoint {path} holds another model: {len(wrong)} tensors differ in shape "
            f"({'; '.join(wrong[:3])}), {len(absent)} are missing ({absent[:3]}) and {len(unknown)} "
            f"are unknown here ({unknown[:3]}); resume with the model= and adapter= it was trained with",
        )


def newest_valid_checkpoint(directory: str | Path) -> Path | None:
    """The newest checkpoint listed in `directory`'s manifest that passes `validate_checkpoint`."""
    found = newest_valid(Path(directory))
    return None if found is None else found[0]


def newest_valid(directory: Path) -> tuple[Path, dict[str, Any]] | None:
    """`ckpt_path=last`: the newest checkpoint the manifest lists that is valid and was written by the
    manifest's run, with its loaded state (so it is read once); None when there is none.

    Entries are plain names in `directory` (`files.Manifest.read` refuses any other). A listed file
    that fails a check, or whose `trace_run.run` is not the manifest's run, is skipped with a warning."""
    manifest = Manifest.read(directory)
    for name in reversed(manifest.files if manifest else []):
        path = directory / name
        try:
            ckpt = validate_checkpoint(path)
        except CheckpointError as err:
            log.warning("ckpt_path=last skips %s: %s", path, err)
            continue
        run = (ckpt.get("trace_run") or {}).get("run")
        if manifest is not None and run != manifest.run:
            log.warning(
                "ckpt_path=last skips %s: written by run %s, the folder's run is %s", path, run, manifest.run
            )
            continue
        return path, ckpt
    return None


def check_strategy(path: str | Path, ckpt: dict[str, Any], fsdp2_processes: int | None) -> None:
    """A sharded folder resumes only under trainer=fsdp2 with the number of processes that wrote it (its
    per-process DataModule states and shard files are per rank); a single file only without fsdp2.
    `fsdp2_processes`: this run's process count under trainer=fsdp2, None without it."""
    folder = ckpt.get(VERIFIED)
    if folder is None:
        if fsdp2_processes is not None:
            raise CheckpointError(
                "strategy_mismatch",
                f"checkpoint {path} is a single file, written without trainer=fsdp2, which resumes only "
                "the sharded folders it writes: resume it without trainer=fsdp2 (the strategy it was "
                "written with)",
            )
        return
    if fsdp2_processes == folder.processes:
        return
    now = f"trainer=fsdp2 with {_processes(fsdp2_processes)}" if fsdp2_processes else "no trainer=fsdp2"
    raise CheckpointError(
        "strategy_mismatch",
        f"checkpoint {path} is a sharded folder written by trainer=fsdp2 with "
        f"{_processes(folder.processes)}, and this run has {now}. Resume it with trainer=fsdp2 and "
        f"trainer.devices x trainer.num_nodes = {folder.processes}, or convert it into one file, which a "
        f"run without trainer=fsdp2 resumes: python -m trace_lightning.checkpoints.convert {path}  "
        "(then pass ckpt_path=<the file it prints>)",
    )


def _processes(n: int) -> str:
    return f"{n} process" if n == 1 else f"{n} processes"
