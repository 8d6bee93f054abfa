"""The weight autoencoder of an ``ls_merge`` recipe: a user's file, a cached one, or a new one.

Trained autoencoders are kept in the method's cache under a key of everything that trained them
(sizes, training settings, seed, package version and the fingerprints of the training models),
so a second recipe over the same models reuses one instead of training again. A cached one
that cannot be read (a missing or truncated ``training.json``, a damaged weights file) is
removed with a warning and trained again.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors import SafetensorError

from lmc_mergekit.errors import LmcError
from lmc_mergekit.latent.autoencoder import WeightAutoencoder, load_autoencoder, save_autoencoder
from lmc_mergekit.latent.chunks import NamedTensor
from lmc_mergekit.latent.training import TrainingConfig, autoencoder_config_for, train_autoencoder
from lmc_mergekit.models.layout import Piece
from lmc_mergekit.runtime.keys import content_key, fingerprint
from lmc_mergekit.runtime.publish import discard, staged_folder

AUTOENCODER_FILE = "autoencoder.safetensors"
RECORD_FILE = "training.json"
#: What reading a damaged or foreign autoencoder file or record raises.
UNREADABLE = (KeyError, RuntimeError, OSError, ValueError, SafetensorError)
#: What a damaged cached autoencoder raises when read (not a file system that is unavailable
#: for a moment, which leaves the entry alone).
DAMAGED = (FileNotFoundError, KeyError, RuntimeError, ValueError, SafetensorError)
LOG = logging.getLogger(__name__)


def obtain_autoencoder(
    settings,
    models: list[Path],
    tensors: Callable[[], list[NamedTensor]],
    cache_dir: Path,
    state_dir: Path,
    device: torch.device,
    progress: bool,
) -> tuple[Path, WeightAutoencoder, dict]:
    """The autoencoder's file, the model (on ``device``) and a record of where it came from:
    ``settings.autoencoder`` if given, else the cached one trained on ``models`` with these
    ``settings`` (the ``latent:`` section), else a new one trained on ``tensors()`` (read only
    then; resumable from ``state_dir``) and cached."""
    if settings.autoencoder is not None:
        path = Path(settings.autoencoder).expanduser().absolute()
        return path, _load_given(path, device), {"source": "given", "path": str(path)}
    training = TrainingConfig(
        steps=settings.steps,
        batch_size=settings.batch_size,
        lr=settings.lr,
        autoencoder_fraction=settings.autoencoder_fraction,
        beta=settings.beta,
        seed=settings.seed,
    )
    sizes = {
        "chunk_size": settings.chunk_size,
        "compression_ratio": settings.compression_ratio,
        "width": settings.width,
        "depth": settings.depth,
    }
    from lmc_mergekit import __version__

    payload = {
        "sizes": sizes,
        "training": asdict(training),
        "models": [fingerprint(path) for path in models],
        "version": __version__,
    }
    key = content_key(payload)
    folder = cache_dir / "autoencoders" / key
    cached = _read_cached(folder, device)
    if cached is not None:
        model, record = cached
        return folder / AUTOENCODER_FILE, model, {**record, "source": "cache"}
    training_tensors = tensors()
    config = autoencoder_config_for(training_tensors, **sizes)
    model, record = train_autoencoder(
        training_tensors,
        config,
        training,
        device,
        progress,
        checkpoint=state_dir / f"autoencoder-{key}.pt",
    )
    record = {
        **record,
        "seed": settings.seed,
        "device": str(device),
        "models": [str(p) for p in models],
    }
    # A concurrent run that finished first wins, so the published file is the one to use.
    with staged_folder(folder, "keep", sweep_siblings=True, complete=AUTOENCODER_FILE) as work:
        save_autoencoder(model, work / AUTOENCODER_FILE)
        (work / RECORD_FILE).write_text(json.dumps(record, indent=2), encoding="utf-8")
    record = json.loads((folder / RECORD_FILE).read_text(encoding="utf-8"))
    model = load_autoencoder(folder / AUTOENCODER_FILE, device)
    return folder / AUTOENCODER_FILE, model, {**record, "source": "trained"}


def _read_cached(folder: Path, device: torch.device) -> tuple[WeightAutoencoder, dict] | None:
    """The autoencoder cached in ``folder`` and its training record; None when there is none,
    or when either cannot be read (the folder is then removed, to be trained again)."""
    if not (folder / AUTOENCODER_FILE).is_file():
        return None
    try:  # read on the CPU: a device that is out of memory is no damage to the cache
        record = json.loads((folder / RECORD_FILE).read_text(encoding="utf-8"))
        model = load_autoencoder(folder / AUTOENCODER_FILE, "cpu")
    except DAMAGED as error:
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:160]
        LOG.warning("cached autoencoder %s is damaged (%s); training it again", folder, reason)
        discard(folder)
        return None
    return model.to(device), record


def _load_given(path: Path, device: torch.device) -> WeightAutoencoder:
    if not path.is_file():
        raise LmcError(
            f"latent: autoencoder {str(path)!r} does not exist; give a .safetensors "
            "file an earlier ls_merge run trained, or drop the key to train one"
        )
    try:
        return load_autoencoder(path, device)
    except UNREADABLE as error:
        raise LmcError(
            f"latent: {path.name} is not a weight autoencoder written by lmc-mergekit "
            f"({str(error).splitlines()[0][:120]}); drop autoencoder: to train one"
        ) from None


def check_fits(autoencoder: WeightAutoencoder, tensors: Iterable[Piece], model: str) -> None:
    """A one-line error unless ``autoencoder`` knows every kind and layer of ``tensors``."""
    config = autoencoder.config
    for named in tensors:
        if named.kind not in config.kinds:
            raise LmcError(
                f"the autoencoder does not fit {model}: it was trained on no tensor of kind "
                f"{named.kind!r}; train one on these models (drop latent: autoencoder:)"
            )
        if named.layer >= config.layers:
            raise LmcError(
                f"the autoencoder does not fit {model}: it knows layers 0-{config.layers - 1}, "
                f"the model has {named.layer + 1}; train one on these models (drop latent: "
                "autoencoder:)"
            )
