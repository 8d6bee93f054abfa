"""Moving the latents of a source model onto a target model of another width, depth or family.

Every target piece (kind, layer) takes the source piece of the same kind (role) at the layer of
the same relative depth. Its per-chunk latents are resampled along the chunk axis to the
target's chunk count (the projection to a common dimension), then moved by the closed-form
Gaussian optimal-transport map fitted between the source and the target latents of those two
layers (all kinds of a layer pooled: one distribution per layer, as the paper fits). The moved
latents are decoded with the target's normalisation. Between families (or tokenizers), a
target piece without a counterpart (a norm only the target's family has; the embeddings and
the head, where the tokenizers differ) keeps the target's own latents.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lmc_mergekit.errors import LmcError
from lmc_mergekit.latent.codec import EncodedTensor
from lmc_mergekit.latent.merging import gaussian_transport
from lmc_mergekit.models.layout import OUTSIDE_BLOCKS, Piece


def layer_map(source_layers: int, target_layers: int) -> dict[int, int]:
    """Target layer → source layer at the same relative depth (first to first, last to last);
    tensors outside the blocks map to themselves."""
    if source_layers < 1 or target_layers < 1:
        raise LmcError("a heterogeneous merge needs models with at least one layer each")
    mapping = {OUTSIDE_BLOCKS: OUTSIDE_BLOCKS}
    for layer in range(target_layers):
        relative = layer / (target_layers - 1) if target_layers > 1 else 0.0
        mapping[layer] = round(relative * (source_layers - 1))
    return mapping


def own_pieces(
    source: set[tuple[str, int]],
    pieces: list[Piece],
    mapping: dict[int, int],
    same_tokenizer: bool,
) -> set[tuple[str, int]]:
    """The target pieces (kind, layer) without a source counterpart: those the source family
    lacks, and, between tokenizers, the embeddings and the head."""
    return {
        (p.kind, p.layer)
        for p in pieces
        if (p.kind, mapping[p.layer]) not in source or (p.layer < 0 and not same_tokenizer)
    }


def check_mapping(
    source: set[tuple[str, int]], pieces: list[Piece], mapping: dict[int, int], source_name: str
) -> None:
    """A one-line error unless every target piece has a source piece (kind, mapped layer)."""
    for piece in pieces:
        if (piece.kind, mapping[piece.layer]) not in source:
            raise LmcError(
                f"no layer mapping for the target's {piece.kind} (layer {piece.layer}): "
                f"{source_name} has no tensor of that kind at layer {mapping[piece.layer]}; "
                "a heterogeneous merge needs models of one family with the same tensor kinds"
            )


def resample_rows(rows: torch.Tensor, count: int) -> torch.Tensor:
    """``(n, k)`` latents linearly resampled along the chunk axis to ``(count, k)``."""
    if rows.shape[0] == count:
        return rows
    if rows.shape[0] == 1:
        return rows.expand(count, -1).clone()
    resampled = F.interpolate(rows.T[None].float(), size=count, mode="linear", align_corners=True)
    return resampled[0].T.to(rows.dtype)


def transport_source(
    source: dict[tuple[str, int], EncodedTensor],
    target: dict[tuple[str, int], EncodedTensor],
    pieces: list[Piece],
    mapping: dict[int, int],
    shrinkage: float,
    source_name: str,
    own: set[tuple[str, int]] = frozenset(),
) -> tuple[dict[tuple[str, int], EncodedTensor], dict]:
    """The source's latents for every target piece (the target's own for the pieces in
    ``own``), and a record of the map per layer."""
    moved = {key: target[key] for key in own}
    mapped = [piece for piece in pieces if (piece.kind, piece.layer) not in own]
    check_mapping(set(source), mapped, mapping, source_name)
    record = {}
    for layer in sorted({piece.layer for piece in mapped}):
        in_layer = [piece for piece in mapped if piece.layer == layer]
        sources = [source[(piece.kind, mapping[layer])] for piece in in_layer]
        targets = [target[(piece.kind, layer)] for piece in in_layer]
        transport = gaussian_transport(
            torch.cat([part.mean for part in sources]),
            torch.cat([part.mean for part in targets]),
            shrinkage,
        )
        record[str(layer)] = {
            "source_layer": mapping[layer],
            "mean_shift": float((transport.target_mean - transport.source_mean).norm()),
        }
        for piece, src, tgt in zip(in_layer, sources, targets, strict=True):
            count = tgt.mean.shape[0]
            moved[(piece.kind, layer)] = EncodedTensor(
                piece.kind,
                layer,
                transport(resample_rows(src.mean, count)),
                resample_rows(src.log_var, count),
                tgt.norm,
            )
    return moved, record
