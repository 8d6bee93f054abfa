"""Healing a converted model: continued training after ``subclone_compensate``.

A smaller model cut from a larger one starts above its donor's loss; a few hundred steps of
training on text close to the model's use recover much of the gap (the size conversion
paper's continued-training race). With a teacher (by default the donor that a conversion's
``subclone_report.json`` names: :func:`choose_teacher`) the steps learn the teacher's
next-token distribution (:mod:`lmc_mergekit.subclone.distill`) instead of the text's tokens
alone. Healing is the tool's one training loop
(:func:`lmc_mergekit.zoo.train.continue_training`: progress, rollback on divergence, a
resumable checkpoint) run on the converted checkpoint, with the held-out loss measured along
the way; the result is written in the source's dtype beside its tokenizer, staged and renamed
into place only when complete and finite.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from lmc_mergekit.data import DataConfig, load_split, load_tokenizer, sample_split
from lmc_mergekit.data.sources import data_fingerprint
from lmc_mergekit.errors import LmcError
from lmc_mergekit.evaluation.loss import mean_token_loss, resolve_device
from lmc_mergekit.models.adapters import open_model
from lmc_mergekit.models.checkpoint import checkpoint_bytes, model_dir, read_config, stored_dtype
from lmc_mergekit.models.view import ModelSpec
from lmc_mergekit.runtime.keys import content_key, fingerprint
from lmc_mergekit.runtime.memory import GIB, available_memory, require_memory
from lmc_mergekit.runtime.precision import SIXTEEN_BIT, native_16bit
from lmc_mergekit.runtime.publish import check_output_free
from lmc_mergekit.subclone.distill import DEFAULT_TEMPERATURE, DEFAULT_WEIGHT, Distillation
from lmc_mergekit.zoo.finetune import train_checkpoint
from lmc_mergekit.zoo.train import CHECKPOINT_EVERY

#: The record written beside the healed weights.
HEAL_INFO = "heal.json"
#: The report a ``subclone_compensate`` merge writes beside its model: it names the donor.
SUBCLONE_REPORT = "subclone_report.json"
#: Defaults for a converted model: a fine-tuning rate, not a from-scratch one.
DEFAULT_LR = 3e-4
DEFAULT_BATCH = 8
#: Held-out evaluations over a run (besides the start and the end).
EVALUATIONS = 10


def heal_steps_to_evaluate(steps: int, every: int | None = None) -> list[int]:
    """Steps before which the held-out loss is measured: the start, every ``every`` steps
    (about a tenth of the run by default) and the end."""
    every = every or max(1, steps // EVALUATIONS)
    return sorted({0, steps, *range(every, steps, every)})


@dataclass(frozen=True)
class TeacherChoice:
    """The teacher a heal distils from (None: the text alone) and why, in a line."""

    folder: Path | None
    why: str


def choose_teacher(source: str | Path, teacher: str | None, distill: bool = True) -> TeacherChoice:
    """The teacher for healing ``source``: ``teacher`` where given, else the one donor that
    ``source``'s :data:`SUBCLONE_REPORT` names, if it can be read here; none without
    ``distill`` or such a donor (then the reason is the line)."""
    folder = model_dir(source)
    if not distill:
        return TeacherChoice(None, "healing on the text alone (--no-teacher)")
    if teacher is not None:
        return TeacherChoice(model_dir(teacher), f"distilling from {teacher} (--teacher)")
    report = folder / SUBCLONE_REPORT
    fallback = "healing on the text alone; --teacher PATH names a teacher of the same tokenizer"
    if not report.is_file():
        return TeacherChoice(
            None, f"{folder.name} has no {SUBCLONE_REPORT} naming a donor: {fallback}"
        )
    donors = [d["donor"] for d in json.loads(report.read_text(encoding="utf-8"))["donors"]]
    if len(donors) != 1:
        return TeacherChoice(None, f"{folder.name} merges {len(donors)} donors: {fallback}")
    try:
        donor = model_dir(donors[0])
    except LmcError as error:
        return TeacherChoice(
            None, f"its donor {donors[0]} cannot be read here ({error}): {fallback}"
        )
    return TeacherChoice(
        donor, f"distilling from its donor {donor} ({SUBCLONE_REPORT}; --no-teacher: text alone)"
    )


def load_teacher(
    student: Path,
    teacher: Path,
    tokenizer,
    device: torch.device,
    temperature: float,
    weight: float,
    trust_remote_code: bool = False,
) -> Distillation:
    """``teacher`` loaded in its stored dtype on ``device``, frozen, as the distillation of
    ``student`` (whose ``tokenizer`` is given), its products in float32 where ``device``
    emulates the stored dtype's; refused in one line when the two do not share a tokenizer and
    vocabulary (a student cannot learn a distribution over other tokens)."""
    sizes = [read_config(f).get("vocab_size") for f in (student, teacher)]
    theirs = load_tokenizer([teacher]).get_vocab()
    if sizes[0] != sizes[1] or theirs != tokenizer.get_vocab():
        raise LmcError(
            f"teacher {teacher.name} has another vocabulary than {student.name} ({sizes[1]} "
            f"against {sizes[0]} embedding rows, {len(theirs)} against "
            f"{len(tokenizer.get_vocab())} tokens): distil from a model of the same tokenizer, "
            "or heal with --no-teacher"
        )
    softcaps = tuple(
        open_model(f, trust_remote_code).spec.final_softcap for f in (student, teacher)
    )
    dtype = stored_dtype(teacher)
    model = AutoModelForCausalLM.from_pretrained(
        str(teacher), dtype=dtype, trust_remote_code=trust_remote_code, use_kernels=False
    ).to(device)
    model.eval().requires_grad_(False)
    emulated = dtype in SIXTEEN_BIT and not native_16bit(dtype, device)
    return Distillation(model, temperature, weight, softcaps, float32_products=emulated)


def heal_memory(spec: ModelSpec, teacher_bytes: int, tokens: int, checkpointing: bool) -> int:
    """The bytes a heal of a student of ``spec`` holds at its peak beyond the process's start
    (estimate): float32 AdamW training (weights, gradients, two moments), the teacher as stored
    (``teacher_bytes``; 0 without one), the activations of ``tokens`` tokens a step (about
    ``10·d + 3·dff`` floats a token and layer; half with ``checkpointing``, which keeps each
    layer's input only) and the loss's logits with their gradient. On the 1B heal of
    ``benchmarks/scale.py heal`` it gives 4 % more than the measured peak RSS."""
    layer = (10 * spec.hidden_size + 3 * spec.intermediate_size) * (2 if checkpointing else 4)
    logits = 3 * 4 * tokens * spec.vocab_size
    return 16 * spec.parameters + teacher_bytes + spec.num_layers * tokens * layer + logits


def heal(
    source: str | Path,
    out: str | Path,
    *,
    steps: int,
    data: DataConfig | None = None,
    batch_size: int = DEFAULT_BATCH,
    lr: float = DEFAULT_LR,
    seed: int = 0,
    evaluate_at: list[int] | None = None,
    test: dict[str, torch.Tensor] | None = None,
    eval_sequences: int = 32,
    device: str = "auto",
    cache_dir: Path | None = None,
    overwrite: bool = False,
    progress: bool = True,
    trust_remote_code: bool = False,
    teacher: str | Path | None = None,
    temperature: float = DEFAULT_TEMPERATURE,
    distill_weight: float = DEFAULT_WEIGHT,
    gradient_checkpointing: bool = False,
) -> dict:
    """Write ``source`` trained on for ``steps`` AdamW steps (float32, warm-up over a tenth,
    cosine decay) to ``out``; return the run's record (also written to ``out/heal.json``).

    With a ``teacher`` (a model folder of the same tokenizer, e.g. :func:`choose_teacher`'s)
    each step's loss is the distillation from it (``temperature``, the KL term's share
    ``distill_weight``: :class:`~lmc_mergekit.subclone.distill.Distillation`); the teacher
    runs in its stored dtype, and its forward's seconds are in the record.
    ``gradient_checkpointing`` recomputes each layer's activations in the backward pass: less
    memory for a large student, more compute (the same steps).

    Training reads the train split of ``data`` (every text it names in equal shares, as a
    calibration does), ``steps × batch_size`` sequences at most, one epoch for the default
    sizes; the held-out losses are measured on ``test`` (named token sequences) or else the
    test split of ``data`` (``eval_sequences`` sequences), at ``evaluate_at`` (default
    :func:`heal_steps_to_evaluate`). With ``cache_dir`` the run keeps a resumable checkpoint
    there: the same command after an interruption resumes where it was.
    """
    if steps < 1 or batch_size < 1:
        raise LmcError(f"steps ({steps}) and batch size ({batch_size}) must be at least 1")
    if not lr > 0:
        raise LmcError(f"learning rate must be positive, not {lr}; try {DEFAULT_LR}")
    folder = model_dir(source)
    out = Path(out).expanduser().absolute()
    check_output_free(out, overwrite)
    data = data or DataConfig()
    tokenizer = load_tokenizer([folder])
    # Data errors come before the (slower) model load.
    train, described = sample_split(data, tokenizer, "train", steps * batch_size)
    if test is None:
        test = {"test": load_split(data, tokenizer, "test", eval_sequences)}
    device = resolve_device(device)
    if device.type == "cpu":  # before any model loads
        stored = 0 if teacher is None else checkpoint_bytes(model_dir(teacher))
        tokens = batch_size * data.seq_len
        spec = open_model(folder).spec
        need = heal_memory(spec, stored, tokens, gradient_checkpointing)
        # What no option lowers: float32 AdamW's state of the student.
        if 16 * spec.parameters > available_memory():
            fits = (
                f"its float32 training state alone (weights, gradients, two moments) is "
                f"{16 * spec.parameters / GIB:.1f} GiB: heal a smaller model, or on a machine "
                "with more memory"
            )
        else:
            fits = "a smaller --batch-size" + ("" if teacher is None else ", --no-teacher")
            if not gradient_checkpointing:
                fits = "--gradient-checkpointing, " + fits
            fits = f"try {fits}"
        require_memory(need, "healing", fits)
    distillation = None
    if teacher is not None:  # refused before the student loads and any step runs
        teacher = model_dir(teacher)
        distillation = load_teacher(
            folder, teacher, tokenizer, device, temperature, distill_weight, trust_remote_code
        )

    def losses(model) -> dict[str, float]:
        return {name: mean_token_loss(model, seqs).loss for name, seqs in test.items()}

    identity = {
        "source": fingerprint(folder),
        "data": data_fingerprint(data.source, data.field),
        "seq_len": data.seq_len,
        "test": {name: content_key(seqs.tolist()) for name, seqs in test.items()},
    }
    taught = None
    if distillation is not None:
        taught = {"model": str(teacher), "temperature": temperature, "weight": distill_weight}
        products = torch.float32 if distillation.float32_products else distillation.teacher.dtype
        taught["products"] = str(products).removeprefix("torch.")
        identity["teacher"] = {**taught, "model": fingerprint(teacher)}
    checkpoint = None
    if cache_dir is not None:
        checkpoint = Path(cache_dir) / "heal" / f"{content_key(identity)}-{steps}.pt"
    started = time.perf_counter()
    record = train_checkpoint(
        folder,
        out,
        train,
        HEAL_INFO,
        {
            "source": str(folder),
            "data": described,
            "teacher": taught,
            "gradient_checkpointing": gradient_checkpointing,
        },
        existing="replace" if overwrite else "refuse",
        device=device,
        trust_remote_code=trust_remote_code,
        gradient_checkpointing=gradient_checkpointing,
        seed=seed,
        steps=steps,
        batch_size=batch_size,
        lr=lr,
        progress=progress,
        desc=f"healing {folder.name}",
        evaluate=losses,
        evaluate_at=heal_steps_to_evaluate(steps) if evaluate_at is None else evaluate_at,
        checkpoint=checkpoint,
        identity=identity,
        # At least ten checkpoints a run: an interruption loses a tenth of it at most.
        checkpoint_every=max(1, min(CHECKPOINT_EVERY, steps // 10)),
        objective=None if distillation is None else distillation.step,
        before_write=None if distillation is None else _teacher_time(distillation, started),
    )
    return record


def _teacher_time(distillation: Distillation, started: float):
    """What the record says of the teacher's cost: its forwards' seconds, and their share of
    the run so far."""

    def note(record: dict) -> None:
        seconds = distillation.teacher_seconds
        record["teacher"]["forward_seconds"] = round(seconds, 2)
        record["teacher"]["share_of_time"] = round(seconds / (time.perf_counter() - started), 3)

    return note
