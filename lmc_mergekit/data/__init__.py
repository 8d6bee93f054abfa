"""Data shipped with the package (see corpus/PROVENANCE.md)."""

from importlib.resources import files
from pathlib import Path


def bundled_corpus_dir() -> Path:
    """Folder of the bundled public-domain text files (the default calibration data)."""
    return Path(str(files(__name__).joinpath("corpus")))


def bundled_text_files() -> list[Path]:
    """The bundled text files, in a fixed order."""
    return sorted(bundled_corpus_dir().glob("*.txt"))
