"""Healing by distillation from the donor: the chunked loss is the whole-logits loss, the
teacher is the converted model's donor by default (and refused when its tokens differ), a
distilled heal moves toward its donor, and rollback and resume stay exact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from safetensors.torch import load_file
from test_heal import Interrupted, heal_args, stop_after
from tiny_models import build_model
from tokenizer_helpers import model_with_tokenizer
from torch.overrides import TorchFunctionMode
from transformers import AutoModelForCausalLM

import lmc_mergekit.models.block_runner as block_runner
import lmc_mergekit.zoo.finetune as finetuning
from lmc_mergekit.cli import main
from lmc_mergekit.data import load_tokenizer
from lmc_mergekit.runtime.precision import Float32Products, native_16bit
from lmc_mergekit.subclone.distill import Distillation
from lmc_mergekit.subclone.heal import HEAL_INFO, SUBCLONE_REPORT, choose_teacher, load_teacher
from lmc_mergekit.zoo.finetune import recompute_activations


def whole_logits_loss(student, teacher, ids, temperature, weight, cap):
    """The reference: both models' whole logits, ``F.kl_div`` and ``F.cross_entropy``."""
    logits = student(input_ids=ids).logits[:, :-1].float()
    with torch.no_grad():  # the teacher's logits in its own dtype, read in float32
        taught = teacher(input_ids=ids).logits[:, :-1].float()
    kl = F.kl_div(
        F.log_softmax(logits / temperature, -1),
        F.log_softmax(taught / temperature, -1),
        log_target=True,
        reduction="none",
    ).sum(-1)
    text = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    return weight * temperature**2 * kl.mean() + (1 - weight) * text


@pytest.mark.parametrize(
    ("variant", "temperature", "weight"),
    [("llama", 2.0, 0.5), ("gemma2_softcap_windows", 1.0, 1.0), ("gpt2_tied", 1.0, 0.5)],
)
def test_chunked_distillation_equals_the_whole_logits_loss(
    tmp_path, monkeypatch, variant, temperature, weight
):
    student = AutoModelForCausalLM.from_pretrained(build_model(variant, tmp_path / "s", seed=0))
    teacher = AutoModelForCausalLM.from_pretrained(
        build_model(variant, tmp_path / "t", seed=1), dtype=torch.bfloat16
    )
    ids = torch.randint(0, student.config.vocab_size, (3, 12))
    cap = getattr(student.config, "final_logit_softcapping", None)
    # Five tokens a chunk: 33 predicted tokens run in seven chunks.
    monkeypatch.setattr(block_runner, "LOGITS_BYTES", 4 * student.config.vocab_size * 5)
    loss = Distillation(teacher, temperature, weight, (cap, cap)).loss(student, ids)
    loss.backward()
    chunked = {name: p.grad.clone() for name, p in student.named_parameters()}
    student.zero_grad()
    reference = whole_logits_loss(student, teacher, ids, temperature, weight, cap)
    reference.backward()
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=1e-6)
    for name, param in student.named_parameters():
        torch.testing.assert_close(chunked[name], param.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_gradient_checkpointing_keeps_the_gradients_and_saves_fewer_activations(tmp_path):
    student = AutoModelForCausalLM.from_pretrained(build_model("llama", tmp_path / "s", seed=0))
    teacher = AutoModelForCausalLM.from_pretrained(
        build_model("llama", tmp_path / "t", seed=1), dtype=torch.bfloat16
    )
    ids = torch.randint(0, student.config.vocab_size, (4, 32))
    distillation = Distillation(teacher)

    def step() -> tuple[int, dict[str, torch.Tensor]]:
        """The bytes autograd keeps for the backward pass, and the gradients."""
        kept = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            kept.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = distillation.loss(student, ids)
        loss.backward()
        grads = {name: p.grad.clone() for name, p in student.named_parameters()}
        student.zero_grad()
        return sum(kept), grads

    student.train()
    plain_bytes, plain = step()
    recompute_activations(student)
    fewer_bytes, recomputed = step()
    assert fewer_bytes < plain_bytes / 2, (fewer_bytes, plain_bytes)
    for name, grad in plain.items():
        torch.testing.assert_close(recomputed[name], grad, rtol=1e-5, atol=1e-7, msg=name)


class LinearDtypes(TorchFunctionMode):
    """Records the input dtype of every ``F.linear`` that reaches it."""

    def __init__(self):
        super().__init__()
        self.seen: set[torch.dtype] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.linear:
            self.seen.add(args[0].dtype)
        return func(*args, **(kwargs or {}))


def test_an_emulated_bf16_teacher_multiplies_in_float32(tmp_path):
    student = AutoModelForCausalLM.from_pretrained(build_model("llama", tmp_path / "s", seed=0))
    teacher = AutoModelForCausalLM.from_pretrained(
        build_model("llama", tmp_path / "t", seed=1), dtype=torch.bfloat16
    )
    ids = torch.randint(0, student.config.vocab_size, (3, 16))
    losses, seen = {}, {}
    for upcast in (False, True):
        with LinearDtypes() as spy:
            losses[upcast] = Distillation(teacher, float32_products=upcast).loss(student, ids)
        seen[upcast] = spy.seen
    # In its stored dtype the teacher's products are bf16; upcast, every one is float32, its
    # weights still bf16, and the loss is the same but for bf16 rounding.
    assert torch.bfloat16 in seen[False] and seen[True] == {torch.float32}
    assert all(p.dtype == torch.bfloat16 for p in teacher.parameters())
    torch.testing.assert_close(losses[True], losses[False], rtol=1e-2, atol=0)


def test_float32_products_take_the_weight_by_position_or_by_name():
    x = torch.randn(2, 8)
    weight, bias = torch.randn(3, 8).bfloat16(), torch.randn(3).bfloat16()
    expected = x @ weight.float().T + bias.float()
    with Float32Products():
        for out in (
            F.linear(x, weight, bias),
            F.linear(x, weight, bias=bias),
            F.linear(input=x, weight=weight, bias=bias),
        ):
            assert out.dtype == torch.float32
            torch.testing.assert_close(out, expected)
        assert F.linear(x, weight=weight).dtype == torch.float32


def test_the_teacher_multiplies_in_float32_where_the_cpu_emulates_bf16(models, monkeypatch):
    tokenizer = load_tokenizer([models["student"]])
    cpu = torch.device("cpu")
    for native in (False, True):
        for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
            monkeypatch.setattr(torch.cpu, probe, lambda native=native: native, raising=False)
        assert native_16bit(torch.bfloat16, cpu) is native
        chosen = load_teacher(models["student"], models["donor"], tokenizer, cpu, 1.0, 0.5)
        assert chosen.float32_products is not native
    assert native_16bit(torch.bfloat16, torch.device("cuda"))


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """A tiny bf16 donor and a student of its tokenizer (another random draw: it starts far
    from the donor), and a model of another tokenizer."""
    root = tmp_path_factory.mktemp("distill")
    folders = {
        "donor": model_with_tokenizer(root / "donor", seed=0),
        "student": model_with_tokenizer(root / "student", seed=1),
        "other": model_with_tokenizer(root / "other", seed=2, book=1),
    }
    for folder in folders.values():
        model = AutoModelForCausalLM.from_pretrained(folder)
        model.to(torch.bfloat16).save_pretrained(folder)
    return folders


def name_donor(student: Path, donor: Path | str) -> None:
    """What a ``subclone_compensate`` merge writes beside its model: the report naming its
    donor."""
    report = {"donors": [{"donor": str(donor), "conversion": {}}]}
    (student / SUBCLONE_REPORT).write_text(json.dumps(report))


def test_the_teacher_is_the_donor_the_report_names_and_heal_says_why_not(models, tmp_path):
    student = models["student"]
    assert choose_teacher(student, None).folder is None  # no report: the text alone
    assert "no subclone_report.json" in choose_teacher(student, None).why
    name_donor(models["student"], models["donor"])
    try:
        chosen = choose_teacher(student, None)
        assert chosen.folder == models["donor"] and "its donor" in chosen.why
        assert choose_teacher(student, None, distill=False).folder is None
        assert choose_teacher(student, str(models["other"])).folder == models["other"]
        name_donor(models["student"], tmp_path / "moved-away")
        gone = choose_teacher(student, None)
        assert gone.folder is None and "cannot be read here" in gone.why
    finally:
        (models["student"] / SUBCLONE_REPORT).unlink()


def test_a_teacher_of_another_tokenizer_is_refused_before_any_step(models, text, tmp_path):
    out = tmp_path / "out"
    args = heal_args(models["student"], out, text, "--teacher", str(models["other"]))
    result = CliRunner().invoke(main, args)
    assert result.exit_code != 0
    line = result.output.strip().splitlines()[-1]
    assert "another vocabulary" in line and "--no-teacher" in line
    assert "held-out loss" not in result.output and not out.exists()


def kl_to(teacher: Path, student: Path, ids: torch.Tensor) -> float:
    taught = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.bfloat16)
    return Distillation(taught).kl(AutoModelForCausalLM.from_pretrained(student), ids)


@pytest.mark.slow
def test_a_distilled_heal_moves_toward_its_donor_and_resumes_exactly(
    models, text, tmp_path, monkeypatch
):
    name_donor(models["student"], models["donor"])
    try:
        distilled, plain = tmp_path / "distilled", tmp_path / "plain"
        taught = CliRunner().invoke(main, heal_args(models["student"], distilled, text))
        assert taught.exit_code == 0, taught.output
        assert "distilling from its donor" in taught.output
        # Recomputing activations changes the memory, not the run.
        alone_args = heal_args(
            models["student"], plain, text, "--no-teacher", "--gradient-checkpointing"
        )
        alone = CliRunner().invoke(main, alone_args)
        assert alone.exit_code == 0, alone.output

        # Interrupted after step 6, the same command resumes there to the same weights.
        interrupted = tmp_path / "interrupted"
        train = finetuning.continue_training
        stopped = stop_after(6)
        monkeypatch.setattr(
            finetuning, "continue_training", lambda *a, **k: train(*a, **k, after_step=stopped)
        )
        failed = CliRunner().invoke(main, heal_args(models["student"], interrupted, text))
        assert isinstance(failed.exception, Interrupted) and not interrupted.exists()
        monkeypatch.setattr(finetuning, "continue_training", train)
        resumed = CliRunner().invoke(main, heal_args(models["student"], interrupted, text))
        assert "resumed at step 6" in resumed.output, resumed.output
    finally:
        (models["student"] / SUBCLONE_REPORT).unlink()
    record = json.loads((distilled / HEAL_INFO).read_text())
    assert record["teacher"]["model"] == str(models["donor"])
    assert record["teacher"]["forward_seconds"] > 0
    plain_record = json.loads((plain / HEAL_INFO).read_text())
    assert plain_record["teacher"] is None and plain_record["gradient_checkpointing"]
    ids = torch.randint(0, 300, (8, 32), generator=torch.Generator().manual_seed(5))
    start = kl_to(models["donor"], models["student"], ids)
    after = {name: kl_to(models["donor"], tmp_path / name, ids) for name in ("distilled", "plain")}
    assert after["distilled"] < start and after["distilled"] < after["plain"]
    whole, again = (load_file(f / "model.safetensors") for f in (distilled, interrupted))
    assert all(torch.equal(whole[n], again[n]) for n in whole)
