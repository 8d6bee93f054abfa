"""Typed records (reports and their parts) that serialise to plain JSON and read back."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, model_serializer


class Record(BaseModel):
    """A typed record. Fields named in ``omit_if_none`` are left out of the JSON when unset
    (a report says nothing of what it did not measure); other None fields stay as null."""

    model_config = ConfigDict(extra="ignore")
    omit_if_none: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _without_absent(self, handler) -> dict:
        data = handler(self)
        for key in self.omit_if_none:
            if data.get(key) is None:
                data.pop(key, None)
        return data

    def write(self, path: Path) -> None:
        """Save as indented JSON."""
        path.write_text(self.model_dump_json(indent=2) + "\n", encoding="utf-8")

    @classmethod
    def read(cls, path: Path):
        """Load a record saved by :meth:`write`."""
        return cls.model_validate_json(path.read_text(encoding="utf-8"))
