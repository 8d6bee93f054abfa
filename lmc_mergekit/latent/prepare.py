"""Models encoded into a weight autoencoder's latent space, one prepared folder per model,
reading, encoding and writing one part (embeddings, a block, the head) at a time.

A prepared folder holds the model's plain encode–decode as a stock checkpoint (what mergekit
loads, and the λ = 0 endpoint) and its latents named after the output's tensors
(:mod:`lmc_mergekit.latent.store`), with each tensor's reconstruction residual for models whose
weights have the output's shape. For a heterogeneous merge, a source's latents are first moved
onto the target's layout and latent distribution (:mod:`lmc_mergekit.latent.heterogeneous`) and
decoded with the target's shapes. Every folder is read back before it is kept.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from lmc_mergekit.data.tokenizer import shares_tokenizer
from lmc_mergekit.errors import LmcError
from lmc_mergekit.latent.autoencoder import WeightAutoencoder
from lmc_mergekit.latent.chunks import NamedTensor
from lmc_mergekit.latent.codec import (
    EncodedTensor,
    SliceDistance,
    decode_tensor,
    decoded_slices,
    encode_tensor,
    relative_error,
)
from lmc_mergekit.latent.heterogeneous import check_mapping, layer_map, own_pieces, transport_source
from lmc_mergekit.latent.store import LatentStore, LatentWriter
from lmc_mergekit.latent.tensor_merge import decoded_key_slices
from lmc_mergekit.models.adapters import CheckpointView, open_model
from lmc_mergekit.models.adapters.base import DEFAULT_SHARD_SIZE
from lmc_mergekit.models.checkpoint import CheckpointReader, ShardWriter, copy_tagalong_files
from lmc_mergekit.models.layout import PartLayout, Piece, part_layouts

# The decoded weights must match the stored latents' decode this closely (relative).
READ_BACK_TOLERANCE = 1e-5


@dataclass(frozen=True)
class LatentInput:
    """A model to encode: its view and its canonical pieces (shapes only: weights are read part
    by part when they are used)."""

    view: CheckpointView
    #: Every canonical tensor of the model (a tied head included), by layer then kind.
    canonical: tuple[Piece, ...]
    #: The canonical tensors the checkpoint's keys are built from (a tied head left out).
    pieces: tuple[Piece, ...]

    @classmethod
    def read(cls, view: CheckpointView) -> LatentInput:
        """Read ``view`` once, part by part, for its pieces (its layout checked on the way)."""
        canonical, used = [], set()
        for part in part_layouts(view.adapter, view):
            canonical += part.tensors
            used |= {piece for layout in part.keys.values() for piece in layout.pieces}
        canonical = sorted(canonical, key=_order)
        return cls(view, tuple(canonical), tuple(p for p in canonical if p in used))

    @property
    def kinds(self) -> set[tuple[str, int]]:
        """(kind, layer) of every canonical tensor."""
        return {(piece.kind, piece.layer) for piece in self.canonical}

    @property
    def family(self) -> str:
        return self.view.spec.architecture

    def moves_onto(self, target: LatentInput) -> bool:
        """Whether this model's latents must be moved onto ``target``'s (another shape or
        family), rather than merged as they are."""
        mismatch = target.view.spec.shape_mismatch(self.view.spec)
        return self.family != target.family or mismatch is not None


def _write_config(view: CheckpointView, out: Path) -> None:
    """``view``'s config.json into ``out``: copied, or rewritten untied for a tied model read
    untied (among inputs that tie their heads differently)."""
    source = view.folder / "config.json"
    if view.spec.tied_embeddings or not open_model(view.folder).spec.tied_embeddings:
        shutil.copy2(source, out / "config.json")
        return
    config = view.adapter.updated_config(json.loads(source.read_text()), view.spec)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _order(piece: Piece) -> tuple[int, str]:
    return piece.layer, piece.kind


def target_only_pieces(target: LatentInput, source: LatentInput) -> set[tuple[str, int]]:
    """The target pieces that keep the target's own latents when ``source`` is moved onto it:
    between families, the kinds the source's family lacks, and between tokenizers the
    embeddings and the head. Within one family every block tensor must have a counterpart (a
    one-line error otherwise)."""
    kinds = source.kinds
    mapping = layer_map(source.view.spec.num_layers, target.view.spec.num_layers)
    same_tokenizer = shares_tokenizer(target.view.folder, source.view.folder)
    own = own_pieces(kinds, list(target.pieces), mapping, same_tokenizer)
    if source.family == target.family:
        gaps = [p for p in target.pieces if (p.kind, p.layer) in own and p.layer >= 0]
        check_mapping(kinds, gaps, mapping, source.view.folder.name)
    return own


Codes = dict[tuple[str, int], EncodedTensor]


def prepare_latents(
    autoencoder: WeightAutoencoder,
    autoencoder_path: Path,
    models: list[LatentInput],
    outputs: list[Path],
    heterogeneous: bool,
    shrinkage: float,
    progress: bool,
) -> tuple[list[dict], dict | None]:
    """Encode every model into its prepared folder in ``outputs``, one part of one model in
    memory at a time; in a heterogeneous merge the first is the target and the others of
    another shape or family are moved onto it. Returns a record per model (role, shape,
    reconstruction error per tensor, seconds) and, heterogeneous, the transport record (layer
    map, the map per layer, the pieces the target kept)."""
    entries, transport, target = [], None, None
    for index, (model, out) in enumerate(zip(models, outputs, strict=True)):
        started = time.perf_counter()
        view = model.view
        role = "input"
        if heterogeneous and index == 0:
            role = "target"
        elif heterogeneous and model.moves_onto(models[0]):
            role = "source"
        if role == "source":
            # Encoded whole first (latents only): the transport is fitted per layer over all
            # of them; then decoded onto the target's layout. No residual: no weights of the
            # output's shape.
            encoded, reconstruction = _encode(autoencoder, model, progress)
            mapping = layer_map(view.spec.num_layers, target[0].view.spec.num_layers)
            own = target_only_pieces(target[0], model)
            encoded, layers = transport_source(
                encoded,
                target[1],
                list(target[0].pieces),
                mapping,
                shrinkage,
                view.folder.name,
                own,
            )
            transport = {
                "layer_map": {str(k): v for k, v in mapping.items()},
                "layers": layers,
                "target_only": sorted(f"{kind}@{layer}" for kind, layer in own),
            }
            _write(out, target[0], autoencoder, autoencoder_path, encoded, False, False, progress)
        else:
            # The target's latents are kept for the transport of the sources onto it.
            target_role = role == "target"
            encoded, reconstruction = _write(
                out, model, autoencoder, autoencoder_path, None, True, target_role, progress
            )
            if target_role:
                target = (model, encoded)
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


def _encode(
    autoencoder: WeightAutoencoder, model: LatentInput, progress: bool
) -> tuple[Codes, dict[str, float]]:
    """Every canonical tensor of ``model`` encoded, and each one's reconstruction error."""
    encoded, reconstruction = {}, {}
    parts = part_layouts(model.view.adapter, model.view)
    name = model.view.folder.name
    for part in tqdm(parts, desc=f"encoding {name}", total=_parts(model), disable=not progress):
        codes = _encode_part(autoencoder, part)
        for piece, tensor in part.tensors.items():
            reconstruction[_name(piece)] = _piece_error(autoencoder, codes[_tag(piece)], tensor)
        encoded.update(codes)
    return encoded, reconstruction


def _encode_part(autoencoder: WeightAutoencoder, part: PartLayout) -> Codes:
    """Every canonical tensor of ``part`` (a tied head too) encoded."""
    return {
        _tag(p): encode_tensor(autoencoder, NamedTensor(p.kind, p.layer, t))
        for p, t in part.tensors.items()
    }


def _piece_error(autoencoder: WeightAutoencoder, code: EncodedTensor, original) -> float:
    """The reconstruction error of one piece, decoded a batch of windows at a time."""
    error, flat = SliceDistance(), original.reshape(-1)
    for start, values in _decoded(autoencoder, code):
        error.add(flat[start : start + len(values)], values)
    return error.relative


def _decoded(autoencoder: WeightAutoencoder, code: EncodedTensor):
    return decoded_slices(autoencoder, code.kind, code.layer, code.mean, code.norm)


def _tag(piece: Piece) -> tuple[str, int]:
    return piece.kind, piece.layer


def _name(piece: Piece) -> str:
    return f"{piece.kind}@{piece.layer}"


def _parts(model: LatentInput) -> int:
    return model.view.spec.num_layers + 2


def _write(
    out: Path,
    like: LatentInput,
    autoencoder: WeightAutoencoder,
    autoencoder_path: Path,
    encoded: Codes | None,
    residuals: bool,
    keep_codes: bool,
    progress: bool,
) -> tuple[Codes, dict[str, float]]:
    """The prepared folder, written part by part of ``like`` (its layout, config.json,
    tokenizer, dtypes and the tensors outside its canonical view, copied): the decode as a
    stock checkpoint, the latents of every tensor and,
    with ``residuals``, each tensor's reconstruction residual (original − decoded). The pieces
    are encoded from ``like``'s own weights unless ``encoded`` gives their latents. Read back
    before it returns. Returns each piece's reconstruction error (its own weights only) and,
    with ``keep_codes``, the latents of every piece (else only one part's are ever held)."""
    out.mkdir(parents=True, exist_ok=True)
    own = encoded is None
    kept: Codes = {}
    reconstruction: dict[str, float] = {}
    writer = ShardWriter(out, DEFAULT_SHARD_SIZE)
    latents = LatentWriter(out, autoencoder_path, residuals)
    verb = "encoding" if own else "writing onto"
    bar = tqdm(total=_parts(like), desc=f"{verb} {like.view.folder.name}", disable=not progress)
    for part in part_layouts(like.view.adapter, like.view):
        codes, errors = _write_part(part, autoencoder, encoded, residuals, writer, latents)
        reconstruction.update(errors)
        if keep_codes and own:
            kept.update(codes)
        del part, codes  # not held while the next part is read and encoded
        bar.update()
    bar.close()
    # Tensors outside the canonical view (a vision tower) have no latents: the merge method
    # averages them as they are (onto a target: the target's).
    for name, tensor in like.view.passthrough():
        writer.write({name: tensor})
    writer.close()
    latents.close()
    _write_config(like.view, out)
    copy_tagalong_files(like.view.folder, out)
    check_prepared(out, autoencoder, like, residuals)
    return kept, reconstruction


def _write_part(
    part: PartLayout,
    autoencoder: WeightAutoencoder,
    encoded: Codes | None,
    residuals: bool,
    writer: ShardWriter,
    latents: LatentWriter,
) -> tuple[Codes, dict[str, float]]:
    """Every key of ``part``: its decode, latents and (with ``residuals``) residual written;
    the part encoded from its own weights unless ``encoded`` gives the latents. Returns the
    part's latents and reconstruction errors. A key that is one piece (an embedding, a head,
    most of a block) is decoded, compared and written a batch of windows at a time: no whole
    float32 decode or residual of a vocabulary-sized matrix is held."""
    own = encoded is None
    codes = _encode_part(autoencoder, part) if own else encoded
    errors: dict[str, float] = {}
    for key, layout in part.keys.items():
        latents.write(key, [codes[_tag(p)] for p in layout.pieces])
        if layout.index is None:
            slices = _decoded(autoencoder, codes[_tag(layout.pieces[0])])
        else:  # a gather needs its pieces whole
            flats = [decode_tensor(autoencoder, codes[_tag(p)]) for p in layout.pieces]
            if own:
                pieces = zip(layout.pieces, flats, strict=True)
                errors.update({_name(p): relative_error(part.tensors[p], f) for p, f in pieces})
            slices = [(0, layout.assemble(flats).reshape(-1))]
        original = None
        if residuals:
            original = layout.assemble([part.tensors[p] for p in layout.pieces]).reshape(-1)
        dtype = part.tensors[layout.pieces[0]].dtype
        error = _write_key(key, layout.shape, dtype, slices, original, writer, latents)
        if own and layout.index is None:
            errors[_name(layout.pieces[0])] = error
    if own:  # pieces no key is built from (a tied head) are reported all the same
        for piece, tensor in part.tensors.items():
            if _name(piece) not in errors:
                errors[_name(piece)] = _piece_error(autoencoder, codes[_tag(piece)], tensor)
    return codes, errors


def _write_key(
    key: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    slices: Iterable[tuple[int, torch.Tensor]],
    original: torch.Tensor | None,
    writer: ShardWriter,
    latents: LatentWriter,
) -> float:
    """The decoded tensor ``key`` written from its ``(start, values)`` ``slices`` (in
    ``dtype``) and, given its ``original`` flat values, its residual ``original − decoded``
    (float64, rounded to float32). Returns the reconstruction error (0 without an original)."""
    error = SliceDistance()
    with ExitStack() as stack:
        decode = stack.enter_context(writer.sink(key, shape, dtype))
        residual = None
        if original is not None:
            residual = stack.enter_context(latents.residual_sink(key, shape))
        for start, values in slices:
            decode.write(values)
            if residual is not None:
                ours = original[start : start + len(values)]
                residual.write(ours.double() - values.double())
                error.add(ours, values)
    return error.relative


def check_prepared(
    out: Path, autoencoder: WeightAutoencoder, like: LatentInput, residuals: bool
) -> None:
    """Read the prepared folder back, part by part of ``like``: every tensor decoded from the
    stored latents (as the merge method will) must be the stored decode, and decode + residual
    ``like``'s original. Decoded, read and compared a slice at a time."""
    store = LatentStore(out)
    written = CheckpointReader(out)
    for part in part_layouts(like.view.adapter, like.view):
        for key, key_layout in part.keys.items():
            original = None
            if residuals:
                original = key_layout.assemble([part.tensors[p] for p in key_layout.pieces])
                original = original.reshape(-1)
            # The stored decode is in the input's dtype: compare at that precision.
            stored, rebuilt = SliceDistance(), SliceDistance()
            for start, values in decoded_key_slices(autoencoder, key_layout, *store.means(key)):
                stop = start + len(values)
                found = written.flat(key, start, stop)
                stored.add(found, values.to(found.dtype))
                if residuals:
                    residual = store.residual_flat(key, start, stop).double()
                    rebuilt.add(original[start:stop], values + residual)
            error = max(stored.symmetric, rebuilt.symmetric)
            if not error <= READ_BACK_TOLERANCE:
                raise LmcError(
                    f"self-check failed: {key!r} decoded from the written latents is "
                    f"{error:.1e} (relative) away from what the pass decoded; nothing was kept"
                )
