"""Models encoded into a weight autoencoder's latent space, one prepared folder per model.

A prepared folder holds the model's plain encode–decode as a stock checkpoint (what mergekit
loads, and the λ = 0 endpoint) and its latents named after the output's tensors
(:mod:`lmc_mergekit.latent.store`), with each tensor's reconstruction residual for models whose
weights have the output's shape. For a heterogeneous merge, a source's latents are first moved
onto the target's layout and latent distribution (:mod:`lmc_mergekit.latent.heterogeneous`) and
decoded with the target's shapes. Every folder is read back before it is kept.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from lmc_mergekit.data.sequences import shares_tokenizer
from lmc_mergekit.errors import LmcError
from lmc_mergekit.latent.autoencoder import WeightAutoencoder
from lmc_mergekit.latent.chunks import NamedTensor, model_tensors
from lmc_mergekit.latent.codec import EncodedTensor, decode_tensor, encode_tensor, relative_error
from lmc_mergekit.latent.heterogeneous import check_mapping, layer_map, own_pieces, transport_source
from lmc_mergekit.latent.store import LatentStore, write_latents
from lmc_mergekit.latent.tensor_merge import decode_key
from lmc_mergekit.models.adapters import CheckpointView
from lmc_mergekit.models.adapters.base import DEFAULT_SHARD_SIZE
from lmc_mergekit.models.checkpoint import CheckpointReader, ShardWriter, copy_tagalong_files
from lmc_mergekit.models.layout import KeyLayout, Piece, checkpoint_layout
from lmc_mergekit.models.view import materialize

# The decoded weights must match the stored latents' decode this closely (relative).
READ_BACK_TOLERANCE = 1e-5


@dataclass(frozen=True)
class LatentInput:
    """A model read for encoding: its view, canonical tensors and checkpoint layout."""

    view: CheckpointView
    tensors: list[NamedTensor]
    layout: dict[str, KeyLayout]

    @classmethod
    def read(cls, view: CheckpointView) -> LatentInput:
        """Read ``view`` once, for both its tensors and its layout."""
        loaded = materialize(view)
        return cls(view, model_tensors(loaded), checkpoint_layout(view.adapter, loaded))

    @property
    def pieces(self) -> list[Piece]:
        """The canonical pieces the layout uses, by layer then kind."""
        found = {piece for key_layout in self.layout.values() for piece in key_layout.pieces}
        return sorted(found, key=lambda piece: (piece.layer, piece.kind))

    @property
    def family(self) -> str:
        return self.view.spec.architecture

    def moves_onto(self, target: LatentInput) -> bool:
        """Whether this model's latents must be moved onto ``target``'s (another shape or
        family), rather than merged as they are."""
        mismatch = target.view.spec.shape_mismatch(self.view.spec)
        return self.family != target.family or mismatch is not None


def target_only_pieces(target: LatentInput, source: LatentInput) -> set[tuple[str, int]]:
    """The target pieces that keep the target's own latents when ``source`` is moved onto it:
    between families, the kinds the source's family lacks, and between tokenizers the
    embeddings and the head. Within one family every block tensor must have a counterpart (a
    one-line error otherwise)."""
    kinds = {(t.kind, t.layer) for t in source.tensors}
    mapping = layer_map(source.view.spec.num_layers, target.view.spec.num_layers)
    same_tokenizer = shares_tokenizer(target.view.folder, source.view.folder)
    own = own_pieces(kinds, target.pieces, mapping, same_tokenizer)
    if source.family == target.family:
        gaps = [p for p in target.pieces if (p.kind, p.layer) in own and p.layer >= 0]
        check_mapping(kinds, gaps, mapping, source.view.folder.name)
    return own


def prepare_latents(
    autoencoder: WeightAutoencoder,
    autoencoder_path: Path,
    models: list[LatentInput],
    outputs: list[Path],
    heterogeneous: bool,
    shrinkage: float,
    progress: bool,
) -> tuple[list[dict], dict | None]:
    """Encode every model into its prepared folder in ``outputs``; in a heterogeneous merge the
    first is the target and the others of another shape or family are moved onto it. Returns a
    record per model (role, shape, reconstruction error per tensor, seconds) and, heterogeneous,
    the transport record (layer map, the map per layer, the pieces the target kept)."""
    entries, transport, target = [], None, None
    for index, (model, out) in enumerate(zip(models, outputs, strict=True)):
        started = time.perf_counter()
        view = model.view
        bar = tqdm(model.tensors, desc=f"encoding {view.folder.name}", disable=not progress)
        encoded = {(t.kind, t.layer): encode_tensor(autoencoder, t) for t in bar}
        decoded = {key: decode_tensor(autoencoder, code) for key, code in encoded.items()}
        reconstruction = {
            f"{t.kind}@{t.layer}": relative_error(t.tensor, decoded[(t.kind, t.layer)])
            for t in model.tensors
        }
        role, like = "input", model
        if heterogeneous and index == 0:
            role, target = "target", (model, encoded)
        elif heterogeneous and model.moves_onto(models[0]):
            role, like = "source", target[0]
            mapping = layer_map(view.spec.num_layers, like.view.spec.num_layers)
            own = target_only_pieces(like, model)
            encoded, layers = transport_source(
                encoded, target[1], like.pieces, mapping, shrinkage, view.folder.name, own
            )
            transport = {
                "layer_map": {str(k): v for k, v in mapping.items()},
                "layers": layers,
                "target_only": sorted(f"{kind}@{layer}" for kind, layer in own),
            }
            decoded = {key: decode_tensor(autoencoder, code) for key, code in encoded.items()}
        originals = {(t.kind, t.layer): t.tensor for t in like.tensors}
        # A source has no weights of the output's shape, hence no reconstruction residual.
        residuals = role != "source"
        write_prepared(out, like, encoded, decoded, originals, residuals, autoencoder_path)
        check_prepared(out, autoencoder, like.layout, originals, residuals)
        entries.append(
            {
                "model": str(view.folder),
                "role": role,
                "shape": view.spec.shape_summary(),
                "reconstruction_error": reconstruction,
                "mean_reconstruction_error": sum(reconstruction.values()) / len(reconstruction),
                "seconds": round(time.perf_counter() - started, 3),
            }
        )
    return entries, transport


def write_prepared(
    out: Path,
    like: LatentInput,
    encoded: dict[tuple[str, int], EncodedTensor],
    decoded: dict[tuple[str, int], torch.Tensor],
    originals: dict[tuple[str, int], torch.Tensor],
    residuals: bool,
    autoencoder: Path,
) -> None:
    """The prepared folder: the decode as a stock checkpoint (layout, config.json and tokenizer
    of ``like``, dtypes of ``originals``), the latents of every tensor and, with ``residuals``,
    each tensor's reconstruction residual (original − decoded)."""
    out.mkdir(parents=True, exist_ok=True)
    writer = ShardWriter(out, DEFAULT_SHARD_SIZE)
    residual = {}
    for key, key_layout in like.layout.items():
        pieces = [(p.kind, p.layer) for p in key_layout.pieces]
        tensor = key_layout.assemble([decoded[piece] for piece in pieces])
        writer.write({key: tensor.to(originals[pieces[0]].dtype)})
        if residuals:
            original = key_layout.assemble([originals[piece].double() for piece in pieces])
            residual[key] = (original - tensor).float()
    writer.close()
    shutil.copy2(like.view.folder / "config.json", out / "config.json")
    copy_tagalong_files(like.view.folder, out)
    write_latents(out, like.layout, encoded, autoencoder, residual)


def check_prepared(
    out: Path,
    autoencoder: WeightAutoencoder,
    layout: dict[str, KeyLayout],
    originals: dict[tuple[str, int], torch.Tensor],
    residuals: bool,
) -> None:
    """Read the prepared folder back: every tensor decoded from the stored latents (as the
    merge method will) must be the stored decode, and decode + residual the original."""
    store = LatentStore(out)
    written = CheckpointReader(out)
    for key, key_layout in layout.items():
        latents, stats = store.get(key)
        decoded = decode_key(autoencoder, key_layout, latents[0], stats)
        stored = written.get(key)  # in the input's dtype: compare at that precision
        error = _distance(stored.double(), decoded.to(stored.dtype).double())
        if residuals:
            pieces = [originals[(p.kind, p.layer)].double() for p in key_layout.pieces]
            rebuilt = decoded + store.residual(key).double()
            error = max(error, _distance(key_layout.assemble(pieces), rebuilt))
        if not error <= READ_BACK_TOLERANCE:
            raise LmcError(
                f"self-check failed: {key!r} decoded from the written latents is {error:.1e} "
                f"(relative) away from what the pass decoded; nothing was kept"
            )


def _distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """``‖a − b‖`` relative to the larger of the two (zero tensors stay comparable)."""
    scale = max(float(a.norm()), float(b.norm()), 1e-30)
    return float((a - b).norm()) / scale
