"""Distillation from the donor: the loss that heals a converted model toward its teacher.

A converted model's donor is the best teacher it will have: healing trains the student on the
donor's next-token distribution (Hinton's soft targets, the step NVIDIA's Minitron takes after
pruning) rather than on the text's one-hot tokens alone. Per predicted token the loss is

    weight · T² · KL(softmax(teacher / T) ‖ softmax(student / T)) + (1 − weight) · CE(student)

(``T²`` keeps the gradient's size independent of ``T``). At real vocabularies (49k–262k) the
logits are never held whole: tokens run through both heads :func:`loss_tokens` at a time
(64 tokens at 262k), each chunk's gradient taken in the forward, a fused linear loss. A token's
row of logits is read whole (1 MB at 262k in float32), so the loss's memory is bounded by the
chunk, not by the batch, the sequence length or a vocabulary slice. The teacher is kept in its
stored dtype and runs under no-grad; where the device emulates its 16-bit products (a CPU
without AVX512-BF16 or AMX) it computes in float32 from its stored weights instead
(:class:`~lmc_mergekit.runtime.precision.Float32Products`, its head a slice of rows at a time),
nearly three times faster there, in its own memory but for float32 activations. Its logits are
read in float32.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from lmc_mergekit.errors import LmcError
from lmc_mergekit.models.block_runner import head_logits, loss_tokens
from lmc_mergekit.runtime.precision import Float32Products

if TYPE_CHECKING:
    from transformers import PreTrainedModel

#: Defaults measured on SmolLM2-135M → d=384 (docs/results.md, "Healing by distillation").
DEFAULT_TEMPERATURE = 1.0
DEFAULT_WEIGHT = 0.5


@dataclass
class Distillation:
    """The teacher and how its distribution is mixed into the loss: ``weight`` is the KL
    term's share (the text's next-token loss has the rest), ``temperature`` softens both
    distributions; ``softcaps`` are the student's and the teacher's final logit caps (None
    where the family has none); with ``float32_products`` the teacher computes in float32 from
    its stored weights (:class:`~lmc_mergekit.runtime.precision.Float32Products`)."""

    teacher: PreTrainedModel
    temperature: float = DEFAULT_TEMPERATURE
    weight: float = DEFAULT_WEIGHT
    softcaps: tuple[float | None, float | None] = (None, None)
    float32_products: bool = False
    #: Seconds the teacher's forwards took so far (a part of every step's cost).
    teacher_seconds: float = field(default=0.0, init=False)

    def __post_init__(self):
        if not self.temperature > 0:
            raise LmcError(f"temperature must be positive, not {self.temperature}; try 1")
        if not 0 <= self.weight <= 1:
            raise LmcError(f"distillation weight must be in [0, 1], not {self.weight}; try 1")

    def step(self, model: PreTrainedModel, batch: torch.Tensor) -> float:
        """One training step's loss of ``model`` on the token sequences ``batch`` ``(n, L)``:
        computed, its gradient accumulated into ``model``'s parameters; returns its value."""
        loss = self.loss(model, batch)
        loss.backward()
        return loss.item()

    def loss(self, model: PreTrainedModel, batch: torch.Tensor) -> torch.Tensor:
        """The mean distillation loss over every predicted token of ``batch`` (differentiable
        with respect to ``model``'s parameters)."""
        started = time.perf_counter()
        upcast = Float32Products() if self.float32_products else contextlib.nullcontext()
        with torch.no_grad(), upcast:
            taught = _last_states(self.teacher, batch)
        if self.float32_products:  # the head then casts its weight a slice of rows at a time
            taught = taught.float()
        self.teacher_seconds += time.perf_counter() - started
        states = _last_states(model, batch)
        head, teacher_head = model.get_output_embeddings(), self.teacher.get_output_embeddings()
        return _DistilledHead.apply(
            states[:, :-1].reshape(-1, states.shape[-1]),
            head.weight,
            head.bias,
            taught[:, :-1].reshape(-1, taught.shape[-1]),
            teacher_head.weight,
            teacher_head.bias,
            batch[:, 1:].reshape(-1).to(states.device),
            self,
        )

    @torch.no_grad()
    def kl(self, model: PreTrainedModel, sequences: torch.Tensor, batch_size: int = 16) -> float:
        """The mean per-token KL(teacher ‖ ``model``) at temperature 1 on ``sequences``: how
        far the student's next-token distribution is from its teacher's."""
        plain = Distillation(self.teacher, 1.0, 1.0, self.softcaps, self.float32_products)
        model.eval()
        total = 0.0
        for batch in sequences.split(batch_size):
            total += float(plain.loss(model, batch)) * len(batch)
        return total / len(sequences)


def _last_states(model: PreTrainedModel, batch: torch.Tensor) -> torch.Tensor:
    """The states the model's head reads (its decoder's output, after the final norm)."""
    device = next(model.parameters()).device
    return model.base_model(input_ids=batch.to(device), use_cache=False).last_hidden_state


def _capped(logits: torch.Tensor, cap: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``c·tanh(logits/c)`` and its derivative (None without a cap)."""
    if not cap:
        return logits, None
    squashed = torch.tanh(logits / cap)
    return squashed * cap, 1 - squashed.square()


class _DistilledHead(torch.autograd.Function):
    """The distillation loss from the last states of student and teacher through their heads,
    :func:`loss_tokens` tokens at a time, each chunk's gradient taken in the forward: no
    tokens × vocabulary tensor beyond one chunk's."""

    @staticmethod
    def forward(ctx, states, weight, bias, taught, teacher_weight, teacher_bias, targets, how):
        wants = ctx.needs_input_grad[:3]
        grads = [
            torch.zeros_like(t) if t is not None and want else None
            for t, want in zip((states, weight, bias), wants, strict=True)
        ]
        temperature, share = how.temperature, how.weight
        cap, teacher_cap = how.softcaps
        total = torch.zeros((), dtype=torch.float32, device=states.device)
        chunk = loss_tokens(weight.shape[0])
        for start in range(0, len(targets), chunk):
            part, wanted = states[start : start + chunk], targets[start : start + chunk]
            logits, slope = _capped(head_logits(part, weight, bias).float(), cap)
            # The teacher's logits as it makes them, in its stored dtype (a 16-bit matmul runs
            # at twice the float32 rate on a CPU that has one, and nothing is cast).
            teacher = head_logits(taught[start : start + chunk], teacher_weight, teacher_bias)
            teacher = _capped(teacher, teacher_cap)[0].float()
            student_t = F.log_softmax(logits / temperature, dim=-1)
            teacher_t = F.log_softmax(teacher / temperature, dim=-1)
            kl = (teacher_t.exp() * (teacher_t - student_t)).sum(-1)
            total += share * temperature**2 * kl.sum()
            if share < 1:  # the text's term, at temperature 1
                log_probs = student_t if temperature == 1 else F.log_softmax(logits, dim=-1)
                total -= (1 - share) * log_probs.gather(1, wanted[:, None]).sum()
                text = log_probs.exp()
                text[torch.arange(len(wanted)), wanted] -= 1
            # d loss / d logits, built in place on the student's probabilities.
            grad = student_t.exp_().sub_(teacher_t.exp_()).mul_(share * temperature)
            if share < 1:
                grad.add_(text, alpha=1 - share)
            if slope is not None:
                grad.mul_(slope)
            if grads[0] is not None:
                grads[0][start : start + chunk] = grad @ weight.to(grad)
            if grads[1] is not None:
                grads[1].addmm_(grad.T.to(weight), part.to(weight))
            if grads[2] is not None:
                grads[2] += grad.sum(0).to(bias)
        count = max(1, len(targets))
        ctx.grads = [None if g is None else g / count for g in grads]
        return total / count

    @staticmethod
    def backward(ctx, outer):
        grads = [None if g is None else g * outer for g in ctx.grads]
        return (*grads, None, None, None, None, None)
