"""Tokenizers as people have them: base and instruct variants that differ in special tokens and
chat template, tokenizers that put BOS before a text, embeddings padded past the tokenizer."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from tokenizer_helpers import make_tokenizer, model_with, tokenizer_variant

from lmc_mergekit.data import (
    SPLITS,
    DataConfig,
    bundled_text_files,
    iter_sequences,
    iter_texts,
    load_split,
    shared_tokenizer,
    shares_tokenizer,
    split_of,
    text_affixes,
)
from lmc_mergekit.errors import LmcError
from lmc_mergekit.evaluation.loss import mean_token_loss
from lmc_mergekit.passes.base import TextSettings
from lmc_mergekit.passes.text import load_recipe_split
from lmc_mergekit.plugin.cli import mergekit_yaml_main

BOOK = bundled_text_files()[0].read_text(encoding="utf-8")
IM_END = "<|im_end|>"
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}"


def folder(path: Path, tokenizer, rows: int) -> Path:
    """A folder that looks like a checkpoint to the tokenizer checks (config.json, tokenizer)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": rows}))
    tokenizer.save_pretrained(path)
    return path


def documents(tmp_path: Path, count: int = 6, size: int = 1500) -> Path:
    """A .jsonl file of ``count`` documents cut from a bundled book."""
    rows = [{"text": BOOK[i * size : (i + 1) * size]} for i in range(count)]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def old_packing(texts: list[str], tokenizer, seq_len: int) -> list[list[int]]:
    """The packing before BOS: each text without special tokens, EOS between texts, the
    stream cut into consecutive ``seq_len`` chunks, the partial last one dropped."""
    stream: list[int] = []
    for number, text in enumerate(texts):
        if number:
            stream.append(tokenizer.eos_token_id)
        stream += tokenizer(text, add_special_tokens=False)["input_ids"]
    return [stream[i : i + seq_len] for i in range(0, len(stream) - seq_len + 1, seq_len)]


# --- what a tokenizer puts around a text -------------------------------------------------------


def test_affixes_of_tokenizers_that_add_nothing_bos_or_an_end_token():
    assert text_affixes(make_tokenizer()) == ([], [])
    gemma = tokenizer_variant(added=("<bos>",), bos="<bos>")
    assert text_affixes(gemma) == ([300], [])
    closing = tokenizer_variant(added=("</s>",), suffix="</s>")
    assert text_affixes(closing) == ([], [300])


def test_a_tokenizer_adding_nothing_packs_as_before(tmp_path):
    tokenizer = make_tokenizer()
    path = documents(tmp_path)
    texts = list(iter_texts(path))
    old = old_packing(texts, tokenizer, 24)
    assert len(old) > 3 * 8
    assert list(iter_sequences(texts, tokenizer, 24)) == old
    config = DataConfig(source=str(path), seq_len=24)
    for split in SPLITS:
        expected = [s for i, s in enumerate(old) if split_of(i) == split]
        assert load_split(config, tokenizer, split).tolist() == expected


def test_a_tokenizer_appending_a_token_packs_as_before(tmp_path):
    """An end token is recorded, never put in the middle of packed sequences."""
    closing = tokenizer_variant(added=("</s>",), suffix="</s>")
    texts = list(iter_texts(documents(tmp_path, count=3)))
    assert list(iter_sequences(texts, closing, 16)) == old_packing(texts, make_tokenizer(), 16)


def test_a_bos_tokenizer_starts_every_sequence_with_bos(tmp_path):
    gemma = tokenizer_variant(added=("<bos>",), bos="<bos>")
    bos = gemma.convert_tokens_to_ids("<bos>")
    path = documents(tmp_path)
    texts = list(iter_texts(path))
    sequences = list(iter_sequences(texts, gemma, 24))
    assert sequences and all(len(s) == 24 and s[0] == bos for s in sequences)
    # After BOS, 23 tokens of the stream each (documents joined by EOS, as before).
    stream = [t for s in old_packing(texts, make_tokenizer(), 1) for t in s]
    assert [t for s in sequences for t in s[1:]] == stream[: 23 * len(sequences)]
    # The first sequence is what the tokenizer makes of the first text.
    assert sequences[0] == gemma(texts[0])["input_ids"][:24]
    # Splits still go by sequence index.
    config = DataConfig(source=str(path), seq_len=24)
    for split in SPLITS:
        expected = [s for i, s in enumerate(sequences) if split_of(i) == split]
        assert load_split(config, gemma, split).tolist() == expected


def test_a_sequence_too_short_for_the_bos_is_refused():
    gemma = tokenizer_variant(added=("<bos>",), bos="<bos>")
    with pytest.raises(LmcError, match=r"no room for text after the 1 tokens .* --seq-len 2"):
        list(iter_sequences(["Some text."], gemma, 1))


# --- which tokenizers go together --------------------------------------------------------------


def test_tokenizers_differing_in_eos_and_template_go_together(tmp_path):
    base = tokenizer_variant(added=(IM_END,))
    instruct = tokenizer_variant(added=(IM_END,), eos=IM_END, chat_template=TEMPLATE)
    a, b = folder(tmp_path / "a", base, 304), folder(tmp_path / "b", instruct, 304)
    shared = shared_tokenizer([a, b])
    assert shared.tokenizer.eos_token == "<|endoftext|>"  # the first model's tokenises
    (difference,) = shared.record.differences
    assert difference.model == str(b.resolve()) and difference.tokens == 301
    assert [d.model_dump() for d in difference.special_tokens] == [
        {
            "name": "eos",
            "first": {"token": "<|endoftext|>", "id": 0},
            "other": {"token": IM_END, "id": 300},
        }
    ]
    assert difference.chat_template_differs
    assert (difference.only_first, difference.only_other) == (0, 0)
    assert shares_tokenizer(a, b)


def test_extra_tokens_on_one_side_go_together(tmp_path):
    a = folder(tmp_path / "a", make_tokenizer(), 300)
    b = folder(tmp_path / "b", tokenizer_variant(added=(IM_END, "<|im_start|>")), 302)
    (difference,) = shared_tokenizer([a, b]).record.differences
    assert (difference.only_first, difference.only_other) == (0, 2)
    assert difference.special_tokens == [] and not difference.chat_template_differs
    assert not shares_tokenizer(a, b)  # the embedding rows differ in number


def test_a_shared_token_with_two_ids_is_refused(tmp_path):
    a = folder(tmp_path / "a", tokenizer_variant(added=("<a>", "<b>")), 302)
    b = folder(tmp_path / "b", tokenizer_variant(added=("<b>", "<a>")), 302)
    message = (
        f"the tokenizers of {a.resolve()} and {b.resolve()} differ: token '<a>' is id 300 in "
        "the first and 301 in the second; models merged or evaluated together need one "
        "vocabulary (use models of one tokenizer family, each with its own tokenizer files)"
    )
    with pytest.raises(LmcError, match=re.escape(message)):
        shared_tokenizer([a, b])
    assert not shares_tokenizer(a, b)


def test_text_past_another_models_rows_is_refused(tmp_path):
    """The first tokenizer's extra token appears in the text; the second model has no row."""
    a = folder(tmp_path / "a", tokenizer_variant(added=(IM_END,)), 301)
    b = folder(tmp_path / "b", make_tokenizer(), 300)
    text = tmp_path / "chat.txt"
    text.write_text(f"{IM_END}{BOOK[:3000]}", encoding="utf-8")  # in the first sequence
    settings = TextSettings(data=str(text), seq_len=8)
    message = f"token '{IM_END}' (id 300), past the 300 embedding rows of {b.resolve()}; list"
    with pytest.raises(LmcError, match=re.escape(message)):
        load_recipe_split((a, b), settings, "test", 8)
    # Listed first, the smaller tokenizer tokenises the text, and every id has a row.
    assert load_recipe_split((b, a), settings, "test", 8).sequences.max() < 300


def test_padded_embeddings_evaluate(tmp_path):
    """More embedding rows than tokens (Qwen pads to 151,936) is a model as people have it."""
    model = model_with(tmp_path / "m", make_tokenizer(), rows=320)
    settings = TextSettings(seq_len=16)
    test = load_recipe_split((model,), settings, "test", 4)
    from transformers import AutoModelForCausalLM

    loss = mean_token_loss(AutoModelForCausalLM.from_pretrained(model), test.sequences).loss
    assert torch.isfinite(torch.tensor(loss))


# --- end to end: a base and an instruct model merged and measured together ---------------------


def test_base_and_instruct_models_merge_and_the_report_names_the_differences(tmp_path):
    """Gemma-style tokenizers (BOS before every text) that differ in eos and chat template,
    on models padded past their tokenizer: lmc_dm merges and measures them together."""
    added = ("<bos>", IM_END)
    base = tokenizer_variant(added=added, bos="<bos>")
    instruct = tokenizer_variant(added=added, bos="<bos>", eos=IM_END, chat_template=TEMPLATE)
    a = model_with(tmp_path / "base", base, rows=320, seed=0)
    b = model_with(tmp_path / "instruct", instruct, rows=320, seed=1)
    recipe = {
        "merge_method": "lmc_dm",
        "models": [{"model": str(m), "parameters": {"weight": 1.0}} for m in (a, b)],
        "dtype": "float32",
        "alignment": {"steps": 0, "seq_len": 16, "eval_sequences": 4, "points": 3},
    }
    path, out = tmp_path / "recipe.yml", tmp_path / "merged"
    path.write_text(yaml.safe_dump(recipe))
    result = CliRunner().invoke(mergekit_yaml_main, [str(path), str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "lmc_report.json").read_text())
    tokenizer = report["data"]["tokenizer"]
    assert tokenizer["prefix"] == [{"token": "<bos>", "id": 300}] and tokenizer["suffix"] == []
    (difference,) = tokenizer["differences"]
    assert difference["special_tokens"] == [
        {
            "name": "eos",
            "first": {"token": "<|endoftext|>", "id": 0},
            "other": {"token": IM_END, "id": 301},
        }
    ]
    assert difference["chat_template_differs"]
    assert all(torch.isfinite(torch.tensor(report["pairs"][0]["raw"]["losses"])))
    card = (out / "README.md").read_text()
    assert "Every sequence starts with `<bos> (300)`" in card
    assert f"eos <|endoftext|> (0) vs {IM_END} (301); the chat template" in card


def test_a_folder_s_tokenizer_is_loaded_once_while_its_files_stay_the_same(tmp_path):
    """A recipe's stages ask for a model's tokenizer several times: the second ask gets the
    loaded one, and a folder whose tokenizer files changed since is read again."""
    import os

    path = folder(tmp_path / "m", make_tokenizer(), 512)
    first = shared_tokenizer([path]).tokenizer
    assert shared_tokenizer([path]).tokenizer is first
    config = path / "tokenizer_config.json"
    stat = config.stat()
    os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    again = shared_tokenizer([path]).tokenizer
    assert again is not first and again.get_vocab() == first.get_vocab()
