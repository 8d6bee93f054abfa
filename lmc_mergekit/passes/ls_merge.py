"""The ``ls_merge`` pre-merge pass: every input encoded into a weight autoencoder's latent space.

The pass obtains the autoencoder (given, cached, or trained on the recipe's models and any
``extra_models``) and writes one prepared folder per input: the input's plain encode–decode as
a stock checkpoint (what mergekit loads, and the λ = 0 endpoint of the report) and its latents
named after the output's tensors. For models of different widths or depths (a heterogeneous
merge onto ``base_model``), each source's latents are first moved onto the target's layout
and latent distribution (:mod:`lmc_mergekit.latent.heterogeneous`). mergekit then runs the
registered ``ls_merge`` method, which averages the latents per tensor and decodes them.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from lmc_mergekit.errors import LmcError
from lmc_mergekit.latent.chunks import model_tensors
from lmc_mergekit.latent.codec import decode_tensor, encode_tensor, relative_error
from lmc_mergekit.latent.heterogeneous import check_mapping, layer_map, transport_source
from lmc_mergekit.latent.store import LatentStore, write_latents
from lmc_mergekit.latent.tensor_merge import decode_key
from lmc_mergekit.models.adapters import open_model
from lmc_mergekit.models.adapters.base import DEFAULT_SHARD_SIZE
from lmc_mergekit.models.checkpoint import CheckpointReader, ShardWriter, copy_tagalong_files
from lmc_mergekit.models.layout import checkpoint_layout
from lmc_mergekit.models.view import materialize
from lmc_mergekit.passes.autoencoder_cache import check_fits, obtain_autoencoder
from lmc_mergekit.passes.context import FinishContext, PassContext, pass_device
from lmc_mergekit.passes.recipe_data import (
    add_merged_loss,
    load_test_split,
    model_test_loss,
)
from lmc_mergekit.plugin.methods import write_provenance
from lmc_mergekit.plugin.recipe import LatentSettings

REPORT_FILE = "ls_report.json"
# Inside each prepared folder: the same input prepared with the second autoencoder (seed + 1).
NOISE_DIR = "noise-floor"
EVALUATE_FIX = "set 'evaluate: false' under latent:"


def run(ctx: PassContext) -> None:
    """Encode every input into ``ctx.outputs`` and write ``ls_report.json``."""
    if not ctx.processes.is_main:
        return  # the pass runs in one process
    settings: LatentSettings = ctx.settings
    views = [open_model(path, ctx.options.trust_remote_code) for path in ctx.inputs]
    extra = [open_model(path, ctx.options.trust_remote_code) for path in settings.extra_models]
    _check_one_family(views + extra)
    if len(views) == 1 and settings.samples == 0:
        raise LmcError(
            "ls_merge got one model and no self-merge setting; set latent: samples: K (a "
            "self-merge of K posterior samples) or list more models"
        )
    kind = _merge_kind(views, ctx)
    test = load_test_split(ctx.inputs, settings, EVALUATE_FIX)
    device = pass_device(ctx.options)
    progress = not ctx.options.quiet
    loaded = [materialize(view) for view in views]  # read once: for encoding and the layout
    tensors = [model_tensors(part) for part in loaded]
    training_tensors = [t for named in tensors for t in named]
    training_tensors += [t for view in extra for t in model_tensors(view)]
    layouts = [
        checkpoint_layout(view.adapter, part) for view, part in zip(views, loaded, strict=True)
    ]
    if kind == "heterogeneous":  # before any training: every target tensor needs a source
        for view, named in zip(views[1:], tensors[1:], strict=True):
            check_mapping(
                {(t.kind, t.layer) for t in named},
                _pieces(layouts[0]),
                layer_map(view.spec.num_layers, views[0].spec.num_layers),
                view.folder.name,
            )
    seeds = [settings.seed]
    if settings.noise_floor and settings.evaluate and settings.autoencoder is None:
        seeds.append(settings.seed + 1)
    autoencoders, entries, transport = [], None, None
    for run_index, seed in enumerate(seeds):
        path, autoencoder, record = obtain_autoencoder(
            settings,
            seed,
            [view.folder for view in views + extra],
            training_tensors,
            ctx.cache_dir,
            ctx.state_dir,
            device,
            progress,
        )
        for view, named in zip(views, tensors, strict=True):
            check_fits(autoencoder, named, view.folder.name)
        autoencoders.append(
            {
                "path": str(path),
                "config": json.loads(autoencoder.config.to_json()),
                "record": record,
            }
        )
        outputs = [out if run_index == 0 else out / NOISE_DIR for out in ctx.outputs]
        prepared = _prepare(
            autoencoder, path, views, tensors, layouts, outputs, kind, settings, progress
        )
        if run_index == 0:
            entries, transport = prepared
        else:  # the pipeline marks only the main prepared folders
            for source, out in zip(ctx.inputs, outputs, strict=True):
                write_provenance(out, "ls_merge", {"source": str(source), "noise_floor": True})
    if test is not None:
        for view, entry, out in zip(views, entries, ctx.outputs, strict=True):
            entry["test_loss"] = {
                "original": model_test_loss(view.folder, test[0], ctx.options),
                "decoded": model_test_loss(out, test[0], ctx.options),
            }
    report = {
        "method": "ls_merge",
        "kind": kind,
        "settings": settings.model_dump(mode="json"),
        "autoencoders": autoencoders,
        "device": str(device),
        "test": None if test is None else test[1],
        "inputs": entries,
        "transport": transport,
    }
    ctx.report_dir.mkdir(parents=True, exist_ok=True)
    (ctx.report_dir / REPORT_FILE).write_text(json.dumps(report, indent=2), encoding="utf-8")


def _check_one_family(views) -> None:
    for view in views[1:]:
        if view.adapter is not views[0].adapter:
            raise LmcError(
                f"ls_merge merges models of one family: {views[0].folder.name} is "
                f"{views[0].spec.architecture}, {view.folder.name} is {view.spec.architecture}"
            )


def _merge_kind(views, ctx: PassContext) -> str:
    """``self-merge``, ``homogeneous`` or ``heterogeneous`` (then the target comes first)."""
    if len(views) == 1:
        return "self-merge"
    mismatch = next(
        (
            (view, found)
            for view in views[1:]
            if (found := views[0].spec.shape_mismatch(view.spec)) is not None
        ),
        None,
    )
    if mismatch is None:
        return "homogeneous"
    view, (key, a, b) = mismatch
    if ctx.base_model is None or ctx.base_model != views[0].folder:
        raise LmcError(
            f"models of different shapes ({key} {a} in {views[0].folder.name}, {b} in "
            f"{view.folder.name}) need a heterogeneous merge: name the target as base_model"
        )
    for view in views[1:]:
        if view.spec.vocab_size != views[0].spec.vocab_size:
            raise LmcError(
                f"{view.folder.name} has a vocabulary of {view.spec.vocab_size}, the target "
                f"{views[0].spec.vocab_size}; a heterogeneous merge needs models that share one "
                "tokenizer"
            )
    return "heterogeneous"


def _prepare(autoencoder, path, views, tensors, layouts, outputs, kind, settings, progress):
    """Encode each input, write its prepared folder, and return a report entry per input and
    (heterogeneous) the transport record."""
    entries, transport, target = [], None, None
    for index, (view, named, out) in enumerate(zip(views, tensors, outputs, strict=True)):
        started = time.perf_counter()
        bar = tqdm(named, desc=f"encoding {view.folder.name}", disable=not progress)
        encoded = {(t.kind, t.layer): encode_tensor(autoencoder, t) for t in bar}
        decoded = {key: decode_tensor(autoencoder, code) for key, code in encoded.items()}
        reconstruction = {
            f"{t.kind}@{t.layer}": relative_error(t.tensor, decoded[(t.kind, t.layer)])
            for t in named
        }
        role, layout, config_from, originals = "input", layouts[index], view, named
        if kind == "heterogeneous" and index == 0:
            role = "target"
        elif kind == "heterogeneous" and views[0].spec.shape_mismatch(view.spec) is not None:
            role = "source"
        if role == "target":
            target = (view, encoded)
        if role == "source":
            target_view, target_encoded = target
            layout, config_from, originals = layouts[0], target_view, tensors[0]
            mapping = layer_map(view.spec.num_layers, target_view.spec.num_layers)
            encoded, transport = transport_source(
                encoded,
                target_encoded,
                _pieces(layout),
                mapping,
                settings.shrinkage,
                view.folder.name,
            )
            transport = {"layer_map": {str(k): v for k, v in mapping.items()}, "layers": transport}
            decoded = {key: decode_tensor(autoencoder, code) for key, code in encoded.items()}
        originals = {(t.kind, t.layer): t.tensor for t in originals}
        # A source has no weights of the output's shape, hence no reconstruction residual.
        residuals = role != "source"
        _write_prepared(out, config_from, layout, encoded, decoded, originals, residuals, path)
        _check_written(out, autoencoder, layout, originals, residuals)
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


def _pieces(layout) -> list:
    """The canonical pieces a checkpoint layout uses, by layer then kind."""
    pieces = {piece for key_layout in layout.values() for piece in key_layout.pieces}
    return sorted(pieces, key=lambda piece: (piece.layer, piece.kind))


def _write_prepared(
    out: Path, config_from, layout, encoded, decoded, originals, residuals: bool, autoencoder
) -> None:
    """The prepared folder: the decode as a stock checkpoint (config.json and tokenizer of
    ``config_from``, dtypes of ``originals``), the latents of every tensor and, with
    ``residuals``, each tensor's reconstruction residual (original − decoded)."""
    out.mkdir(parents=True, exist_ok=True)
    writer = ShardWriter(out, DEFAULT_SHARD_SIZE)
    residual = {}
    for key, key_layout in layout.items():
        pieces = [(p.kind, p.layer) for p in key_layout.pieces]
        tensor = key_layout.assemble([decoded[piece] for piece in pieces])
        writer.write({key: tensor.to(originals[pieces[0]].dtype)})
        if residuals:
            original = key_layout.assemble([originals[piece].double() for piece in pieces])
            residual[key] = (original - tensor).float()
    writer.close()
    shutil.copy2(config_from.folder / "config.json", out / "config.json")
    copy_tagalong_files(config_from.folder, out)
    write_latents(out, layout, encoded, autoencoder, residual)


def _check_written(out: Path, autoencoder, layout, originals, residuals: bool) -> None:
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
        if not error <= 1e-5:
            raise LmcError(
                f"self-check failed: {key!r} decoded from the written latents is {error:.1e} "
                f"(relative) away from what the pass decoded; nothing was kept"
            )


def _distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """``‖a − b‖`` relative to the larger of the two (zero tensors stay comparable)."""
    scale = max(float(a.norm()), float(b.norm()), 1e-30)
    return float((a - b).norm()) / scale


def finish(ctx: FinishContext) -> str:
    """Add the merged loss, the weight-averaging comparison and the noise floor to the
    report; the card's summary."""
    report = add_merged_loss(ctx, REPORT_FILE, LatentSettings, EVALUATE_FIX)
    if report is None:
        return ""
    for entry in report["inputs"]:  # where this merge's prepared checkpoints are
        entry["prepared"] = str(ctx.prepared[entry["model"]])
    settings = LatentSettings.model_validate(report["settings"])
    test = load_test_split(ctx.inputs, settings, EVALUATE_FIX)
    if test is not None:
        sequences = test[0]
        report["weight_average"] = _weight_average(ctx, report, sequences)
        report["noise_floor"] = _noise_floor(ctx, report, sequences)
    (ctx.folder / REPORT_FILE).write_text(json.dumps(report, indent=2), encoding="utf-8")
    return card_section(report)


def _weight_average(ctx: FinishContext, report: dict, sequences) -> dict:
    """The same recipe merged by mergekit's ``linear`` on the original checkpoints."""
    if report["kind"] == "heterogeneous":
        return {"test_loss": None, "note": "weights of different shapes cannot be averaged"}
    if report["kind"] == "self-merge":
        return {
            "test_loss": report["inputs"][0]["test_loss"]["original"],
            "note": "one model: weight averaging returns it unchanged",
        }
    from mergekit.merge import run_merge

    config = ctx.recipe.config.model_copy(update={"merge_method": "linear"}, deep=True)
    with tempfile.TemporaryDirectory(prefix="ls-weight-average-") as folder:
        options = ctx.options.model_copy(update={"write_model_card": False})
        run_merge(config, folder, options, ctx.recipe.source)
        loss = model_test_loss(Path(folder), sequences, ctx.options)
    return {"test_loss": loss, "note": "mergekit linear with the recipe's weights"}


def _noise_floor(ctx: FinishContext, report: dict, sequences) -> dict | None:
    """The merge redone through mergekit with the second autoencoder's latents."""
    prepared = {source: folder / NOISE_DIR for source, folder in ctx.prepared.items()}
    if not all(folder.is_dir() for folder in prepared.values()):
        return None
    from lmc_mergekit.plugin.pipeline import merge_prepared

    with tempfile.TemporaryDirectory(prefix="ls-noise-floor-") as folder:
        merge_prepared(ctx.recipe, prepared, Path(folder), ctx.options)
        loss = model_test_loss(Path(folder), sequences, ctx.options)
    merged = report["merged"]["test_loss"]
    return {
        "seeds": [a["record"].get("seed") for a in report["autoencoders"]],
        "merged_test_losses": [merged, loss],
        "spread": abs(merged - loss),
    }


def card_section(report: dict) -> str:
    """Markdown: the autoencoder, each input's reconstruction and losses, the merge against
    weight averaging, the noise floor."""
    settings = report["settings"]
    first = report["autoencoders"][0]
    record = first["record"]
    lines = [
        "### Latent-space merge (lmc-mergekit report)\n",
        f"A {report['kind']} merge through a weight autoencoder (chunks of "
        f"{first['config']['chunk_size']}, compression ratio "
        f"{first['config']['compression_ratio']:g}, {record.get('source', 'given')}"
        + (f", {record['steps']} steps in {record['seconds']:.0f} s" if "steps" in record else "")
        + f"). Posterior samples per model: {settings['samples'] or 'none (posterior means)'}; "
        + (
            "the inputs' reconstruction residuals added back to the decoded merge.\n"
            if settings["keep_residuals"]
            else "plain decode (reconstruction residuals not kept).\n"
        ),
    ]
    header = "| input | role | mean reconstruction error |"
    if report.get("test"):
        header += " original test loss | decoded test loss (λ = 0) |"
    lines += [header, "|" + "---|" * (header.count("|") - 1)]
    for entry in report["inputs"]:
        row = (
            f"| `{Path(entry['model']).name}` | {entry['role']} | "
            f"{entry['mean_reconstruction_error']:.3f} |"
        )
        if "test_loss" in entry:
            loss = entry["test_loss"]
            row += f" {loss['original']:.3f} | {loss['decoded']:.3f} |"
        lines.append(row)
    if report["kind"] == "heterogeneous" and report.get("test"):
        lines.append(
            "\nThe source's decoded loss is that of its latents moved onto the target "
            "(optimal transport only, no interpolation)."
        )
    if "merged" in report:
        lines.append(f"\nMerged model test loss: {report['merged']['test_loss']:.3f}.")
    average = report.get("weight_average")
    if average and average["test_loss"] is not None:
        lines.append(f"Plain weight averaging ({average['note']}): {average['test_loss']:.3f}.")
    noise = report.get("noise_floor")
    if noise:
        lines.append(
            f"Noise floor (autoencoder seeds {noise['seeds'][0]} and {noise['seeds'][1]}): "
            f"merged losses {noise['merged_test_losses'][0]:.3f} and "
            f"{noise['merged_test_losses'][1]:.3f}, spread {noise['spread']:.3f}."
        )
    return "\n".join(lines)
