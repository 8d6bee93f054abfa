"""The bundled public-domain corpus (see corpus/PROVENANCE.md): the default text everywhere."""

from importlib.resources import files
from pathlib import Path


def bundled_corpus_dir() -> Path:
    """Folder of the bundled public-domain text files (the default calibration data)."""
    return Path(str(files("lmc_mergekit.data").joinpath("corpus")))


def bundled_text_files() -> list[Path]:
    """The bundled text files, in a fixed order."""
    return sorted(bundled_corpus_dir().glob("*.txt"))
