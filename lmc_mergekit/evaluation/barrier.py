"""The loss along the straight line between two models, and its barrier.

``L(λ)`` is the mean token loss of ``(1-λ)·A + λ·B`` on held-out text. The barrier is the highest
loss on the path minus the mean of the two endpoint losses: zero when the two models sit in one
linearly connected basin, large when their plain average is a worse model than either.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from pydantic import ConfigDict, computed_field
from tqdm.auto import tqdm

from lmc_mergekit.errors import LmcError
from lmc_mergekit.evaluation.blockwise import MixedView, blockwise_loss
from lmc_mergekit.evaluation.loss import mean_token_loss
from lmc_mergekit.evaluation.selfcheck import load_fp32, runs_blockwise
from lmc_mergekit.models.adapters import open_model
from lmc_mergekit.models.block_runner import BlockRunner
from lmc_mergekit.models.checkpoint import CheckpointReader, row_slices
from lmc_mergekit.models.view import ModelView
from lmc_mergekit.repair import RepairedView, repair_statistics
from lmc_mergekit.runtime.records import Record

DEFAULT_POINTS = 11


class PathLoss(Record):
    """Losses on an evenly spaced λ grid from A (λ=0) to B (λ=1)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    lambdas: tuple[float, ...]
    losses: tuple[float, ...]
    tokens: int

    @property
    def endpoint_mean(self) -> float:
        return (self.losses[0] + self.losses[-1]) / 2

    @computed_field
    @property
    def barrier(self) -> float:
        """``max_λ L(λ) - (L(0) + L(1)) / 2``."""
        return max(self.losses) - self.endpoint_mean

    @computed_field
    @property
    def endpoint_losses(self) -> tuple[float, float]:
        """``L(0)`` and ``L(1)``."""
        return self.losses[0], self.losses[-1]

    def loss_at(self, lam: float) -> float:
        """The loss at a grid point (raises unless ``lam`` is on the grid)."""
        for grid_lam, loss in zip(self.lambdas, self.losses, strict=True):
            if abs(grid_lam - lam) < 1e-9:
                return loss
        raise LmcError(f"λ={lam} is not on the evaluated grid {list(self.lambdas)}")


def lambda_grid(points: int) -> tuple[float, ...]:
    """``points`` evenly spaced values from 0 to 1 (at least 3, so the path has a middle)."""
    if points < 3:
        raise LmcError(f"the λ grid needs at least 3 points, got {points}")
    return tuple(i / (points - 1) for i in range(points))


def path_mix(
    a: ModelView, b: ModelView, lam: float, runner: BlockRunner, repair_on: torch.Tensor | None
) -> ModelView:
    """``(1-λ)·a + λ·b`` made part by part; with ``repair_on`` (calibration sequences), its
    statistics repaired on them first (an endpoint needs no repair)."""
    mix = MixedView(a, b, lam)
    if repair_on is None or not 0 < lam < 1:
        return mix
    return RepairedView(mix, repair_statistics((a, b), (1 - lam, lam), mix, runner, repair_on))


def interpolation_losses(
    model_a: str | Path,
    model_b: str | Path,
    sequences: torch.Tensor,
    *,
    points: int = DEFAULT_POINTS,
    batch_size: int = 16,
    device: torch.device | str = "cpu",
    progress: bool = False,
    repair_on: torch.Tensor | None = None,
    known: Mapping[float, float] | None = None,
) -> PathLoss:
    """``L(λ)`` on the grid. Where the family runs block by block, each mix is made part by
    part as it runs (:mod:`.blockwise`: one block of each endpoint and a group's residual
    stream in memory); otherwise on one float32 model object whose weights are set in place,
    for each λ, to ``lerp(A, B, λ)`` read from the two checkpoints a slice of rows at a time.
    Where one endpoint ties its LM head to its embeddings and the other does not, the path
    runs untied (the tied one's head is its embedding). With ``repair_on`` (calibration
    sequences), each mix has its statistics repaired on them first (:mod:`lmc_mergekit.repair`).
    ``known`` gives the losses of grid points already measured (the same function measured
    elsewhere: an endpoint, a merged model): they are taken as they are, not evaluated again."""
    grid = lambda_grid(points)
    given = (known or {}).items()
    known = {g: loss for lam, loss in given for g in grid if abs(g - lam) < 1e-9}
    todo = [lam for lam in grid if lam not in known]
    views = [open_model(Path(model_a)), open_model(Path(model_b))]
    _check_same_model(*views)
    tokens = sequences.shape[0] * (sequences.shape[1] - 1)
    bar = tqdm(todo, desc="loss along the path", disable=not progress, leave=False)
    if runs_blockwise(views[0]):
        device = torch.device(device)
        runner = BlockRunner(views[0].folder, views[0].adapter, views[0].spec, device)
        for lam in bar:
            mix = path_mix(*views, lam, runner, repair_on)
            known[lam] = blockwise_loss(mix, runner, sequences).loss
    elif todo:
        if repair_on is not None:
            raise LmcError(
                f"a statistics repair runs block by block, which {views[0].spec.architecture} "
                "checkpoints of this kind cannot; set repair: false"
            )
        a, b, untied = endpoint_readers(*views)
        model = load_fp32(Path(model_a), untie=untied).to(device)
        ends = _Endpoints(model, a, b)
        for lam in bar:
            ends.interpolate(lam)
            known[lam] = mean_token_loss(model, sequences, batch_size=batch_size).loss
    return PathLoss(lambdas=grid, losses=tuple(known[lam] for lam in grid), tokens=tokens)


#: Elements of one endpoint slice read at a time (rows of a large tensor).
SLICE_ELEMENTS = 2**24


class _Endpoints:
    """The two endpoints' checkpoints and, for every floating weight of ``model`` (A, loaded
    through ``transformers``), the checkpoint tensor ``transformers`` loaded it from (by its
    own renaming of checkpoint keys; checked: the weight must hold that tensor of A). A weight
    tied to another is set through that one."""

    def __init__(self, model, a: CheckpointReader, b: CheckpointReader):
        self.a, self.b = a, b
        model_a = a.folder
        _check_same_tensors(a, b, model_a, b.folder)
        state = model.state_dict()
        loaded_from = _loaded_from(model, self.a.names, state)
        # A buffer the checkpoint does not store is made from the config: A's is B's.
        made = {name for name, _ in model.named_buffers()} - loaded_from.keys()
        self.targets: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for name, target in state.items():
            if not target.is_floating_point() or target.data_ptr() in seen or name in made:
                continue
            seen.add(target.data_ptr())
            key = loaded_from.get(name)
            # A head untied from A's embeddings was not loaded: it is set at every λ.
            if key is None or not (key in a.aliases or self._holds(target, key)):
                raise LmcError(
                    f"{model_a}: transformers loads {name!r} from no tensor of the checkpoint "
                    "as it is; the path cannot be evaluated from the checkpoints"
                )
            self.targets[key] = target

    def _holds(self, target: torch.Tensor, key: str) -> bool:
        """Whether ``target`` holds checkpoint A's ``key`` (as loaded: in float32)."""
        if self.a.shape(key) != tuple(target.shape):
            return False
        return all(
            torch.equal(_read(self.a, key, rows).to(target), _rows(target, rows))
            for rows in _slices(target)
        )

    @torch.no_grad()
    def interpolate(self, lam: float) -> None:
        """Every weight set to ``lerp(A, B, λ)`` (float32, on the model's device)."""
        for key, target in self.targets.items():
            for rows in _slices(target):
                a, b = (_read(reader, key, rows).to(target) for reader in (self.a, self.b))
                _rows(target, rows).copy_(torch.lerp(a, b, lam))


def endpoint_readers(*views) -> tuple[CheckpointReader, CheckpointReader, bool]:
    """Readers of the two views' checkpoints, and whether the path must run untied: where
    exactly one ties its LM head to its embeddings, its reader also gives the embedding under
    the key the other stores its head under."""
    readers = [CheckpointReader(view.folder) for view in views]
    tied = [view.spec.tied_embeddings for view in views]
    if tied[0] == tied[1]:
        return readers[0], readers[1], False
    which = tied.index(True)
    head, _ = views[1 - which].adapter.tie_keys(readers[1 - which])
    _, embeddings = views[which].adapter.tie_keys(readers[which])
    readers[which] = CheckpointReader(views[which].folder, {head: embeddings})
    return readers[0], readers[1], True


def _loaded_from(model, keys: frozenset[str], state: dict) -> dict[str, str]:
    """State-dict name → the checkpoint key ``transformers`` loads it from, by its renaming of
    checkpoint keys (GPT-NeoX's ``embed_out``, multimodal Gemma 3's ``language_model.model``);
    keys it converts by computation are left out."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    renamings = [m for m in get_model_conversion_mapping(model) if isinstance(m, WeightRenaming)]
    prefix = model.base_model_prefix
    names = {}
    for key in sorted(keys):
        name, _ = rename_source_key(key, renamings, [], prefix, state)
        if name not in state and key in state:
            name, _ = rename_source_key(key, [], [], prefix, state)
        names.setdefault(name, key)
    return names


def _slices(tensor: torch.Tensor) -> list[tuple[int, int] | None]:
    """Row ranges of ``tensor`` of about :data:`SLICE_ELEMENTS` elements each, or ``[None]``
    (the whole tensor) when it is no larger."""
    if tensor.numel() <= SLICE_ELEMENTS:
        return [None]
    return [(rows.start, rows.stop) for rows in row_slices(tensor, SLICE_ELEMENTS)]


def _read(reader: CheckpointReader, key: str, rows: tuple[int, int] | None) -> torch.Tensor:
    return reader.get(key) if rows is None else reader.rows(key, *rows)


def _rows(tensor: torch.Tensor, rows: tuple[int, int] | None) -> torch.Tensor:
    return tensor if rows is None else tensor[rows[0] : rows[1]]


def _check_same_model(a, b) -> None:
    if a.spec.architecture != b.spec.architecture:
        raise LmcError(
            f"{a.folder} is {a.spec.architecture} but {b.folder} is {b.spec.architecture}; the "
            "path needs two models of one architecture and shape"
        )
    mismatch = a.spec.shape_mismatch(b.spec)
    if mismatch is not None:
        key, size_a, size_b = mismatch
        raise LmcError(
            f"{key} is {size_a} in {a.folder} but {size_b} in {b.folder}; the path needs two "
            "models of one shape"
        )


def _check_same_tensors(a: CheckpointReader, b: CheckpointReader, model_a, model_b) -> None:
    if a.names != b.names:
        only = sorted(a.names ^ b.names)[:3]
        raise LmcError(
            f"{model_a} and {model_b} have different parameters ({', '.join(only)}); the path "
            "needs two models of one architecture and shape"
        )
    for name in sorted(a.names):
        if a.shape(name) != b.shape(name):
            raise LmcError(
                f"{name} is {a.shape(name)} in {model_a} but {b.shape(name)} in {model_b}; "
                "the path needs two models of one shape"
            )


def write_path_json(path: Path, curves: dict[str, PathLoss], extra: dict | None = None) -> None:
    """The curves (and any extra fields) as JSON."""
    payload = dict(extra or {})
    payload["curves"] = {label: curve.model_dump(mode="json") for label, curve in curves.items()}
    path.write_text(json.dumps(payload, indent=2), encoding="utf-8")


def plot_paths(path: Path, curves: dict[str, PathLoss], title: str) -> None:
    """A PNG of the loss along the path, one line per curve, barriers in the legend."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    for label, curve in curves.items():
        ax.plot(
            curve.lambdas, curve.losses, marker="o", label=f"{label} (barrier {curve.barrier:.3f})"
        )
    ax.set_xlabel("λ  (0 = model A, 1 = model B)")
    ax.set_ylabel("test loss (nats per token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def format_table(curves: dict[str, PathLoss]) -> str:
    """A plain-text table: one row per λ, one column per curve, the barriers at the bottom."""
    labels = list(curves)
    grid = curves[labels[0]].lambdas
    width = max(12, *(len(label) + 2 for label in labels))
    lines = [f"{'λ':>8}" + "".join(f"{label:>{width}}" for label in labels)]
    for index, lam in enumerate(grid):
        row = "".join(f"{curves[label].losses[index]:>{width}.4f}" for label in labels)
        lines.append(f"{lam:8.2f}{row}")
    lines.append(f"{'barrier':>8}" + "".join(f"{curves[lb].barrier:>{width}.4f}" for lb in labels))
    return "\n".join(lines)
