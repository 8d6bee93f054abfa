"""The loss along the straight line between two models, and its barrier.

``L(λ)`` is the mean token loss of ``(1-λ)·A + λ·B`` on held-out text. The barrier is the highest
loss on the path minus the mean of the two endpoint losses: zero when the two models sit in one
linearly connected basin, large when their plain average is a worse model than either.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from pydantic import ConfigDict, computed_field
from tqdm.auto import tqdm

from lmc_mergekit.errors import LmcError
from lmc_mergekit.evaluation.loss import mean_token_loss
from lmc_mergekit.evaluation.selfcheck import load_fp32
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


def interpolation_losses(
    model_a: str | Path,
    model_b: str | Path,
    sequences: torch.Tensor,
    *,
    points: int = DEFAULT_POINTS,
    batch_size: int = 16,
    device: torch.device | str = "cpu",
    progress: bool = False,
) -> PathLoss:
    """``L(λ)`` on the grid, evaluated by loading interpolated weights into one model object."""
    grid = lambda_grid(points)
    model = load_fp32(Path(model_a)).to(device)
    start = {name: t.detach().clone() for name, t in model.state_dict().items()}
    end = _matching_state(start, load_fp32(Path(model_b)).state_dict(), model_a, model_b)
    losses = []
    for lam in tqdm(grid, desc="loss along the path", disable=not progress, leave=False):
        state = {
            name: torch.lerp(a, end[name].to(a.device), lam) if a.is_floating_point() else a
            for name, a in start.items()
        }
        model.load_state_dict(state)
        result = mean_token_loss(model, sequences, batch_size=batch_size)
        losses.append(result.loss)
    return PathLoss(lambdas=grid, losses=tuple(losses), tokens=result.tokens)


def _matching_state(start: dict, end: dict, model_a, model_b) -> dict:
    if start.keys() != end.keys():
        only = sorted(start.keys() ^ end.keys())[:3]
        raise LmcError(
            f"{model_a} and {model_b} have different parameters ({', '.join(only)}); the path "
            "needs two models of one architecture and shape (tied vs untied embeddings count)"
        )
    for name, tensor in start.items():
        if tensor.shape != end[name].shape:
            raise LmcError(
                f"{name} is {tuple(tensor.shape)} in {model_a} but {tuple(end[name].shape)} in "
                f"{model_b}; the path needs two models of one shape"
            )
    return end


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
