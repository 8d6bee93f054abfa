"""Local folders for the models a plugin recipe names, found as mergekit finds them.

A recipe names a model as a local folder, a Hub id ``org/name`` or ``org/name@revision`` (a
branch, tag or commit), and either of these ``+`` a LoRA adapter. Hub ids are resolved by
``huggingface_hub.snapshot_download``, as mergekit resolves them: from the Hugging Face cache
(``HF_HUB_CACHE``/``HF_HOME``, or mergekit's ``--transformers-cache``) and, where the Hub can be
reached, by downloading (``HF_TOKEN`` for gated and private repositories); with
``HF_HUB_OFFLINE=1`` only the cache is read. The folder found is the snapshot of the resolved
commit, so every cache key built from it names the commit. A LoRA adapter is merged into its
model by mergekit's own ``ModelReference.merged`` (peft's ``merge_and_unload``), into
mergekit's ``--lora-merge-cache`` or the plugin's cache, published only when complete.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from mergekit.common import ModelPath, ModelReference
from mergekit.config import MergeConfiguration
from mergekit.options import MergeOptions

from lmc_mergekit.errors import LmcError
from lmc_mergekit.models.checkpoint import check_checkpoint, copy_tagalong_files, model_dir
from lmc_mergekit.passes.base import Section
from lmc_mergekit.plugin.inputs import is_hub_id, map_references
from lmc_mergekit.runtime.publish import staged_folder

# What a checkpoint folder needs from a Hub repository (weights, configs, tokenizer files and
# chat templates); mergekit's own list is ``tokenizer.model``, ``*.json`` and the weights.
HUB_PATTERNS = (
    "*.json",
    "*.safetensors",
    "tokenizer.model",
    "spiece.model",
    "merges.txt",
    "vocab.txt",
    "*.jinja",
)
LORA_DIR = "lora"


@dataclass(frozen=True)
class LocalModels:
    """A recipe's configuration and plugin section with every model they name as a local
    folder, and, for each of the recipe's model folders, the reference as the recipe wrote it."""

    config: MergeConfiguration
    settings: Section
    written: dict[Path, str]


def resolve_models(
    config: MergeConfiguration, settings: Section, options: MergeOptions, cache_dir: Path
) -> LocalModels:
    """``config`` with every model (Hub ids, revisions and LoRA adapters included) replaced by
    a checked local checkpoint folder, and ``settings`` with the Hub ids among its model keys
    (:attr:`Section.model_keys`) replaced by their snapshots; LoRA merges go to
    ``--lora-merge-cache`` or ``cache_dir/lora``."""
    written: dict[Path, str] = {}
    lora_cache = Path(options.lora_merge_cache or cache_dir / LORA_DIR).expanduser()

    def local(ref: ModelReference) -> ModelReference:
        folder = model_folder(ref.model, options.transformers_cache)
        if ref.lora is not None:
            adapter = _adapter_folder(ref.lora, options.transformers_cache)
            folder = merge_lora(folder, adapter, lora_cache, options)
        check_checkpoint(folder)
        written.setdefault(folder, str(ref))
        return ref.model_copy(update={"model": ModelPath(path=str(folder)), "lora": None})

    return LocalModels(map_references(config, local), _local_settings(settings, options), written)


def _local_settings(settings: Section, options: MergeOptions) -> Section:
    """``settings`` with each Hub id among its model keys replaced by its snapshot folder
    (only config.json where the pass reads nothing else); local paths are left to the pass."""
    updates = {}
    for key, weights in settings.model_keys.items():
        value = getattr(settings, key)
        patterns = HUB_PATTERNS if weights else ("*.json",)

        def local(path: str, patterns=patterns) -> str:
            if Path(path).expanduser().exists() or not is_hub_id(path):
                return path
            return str(
                _snapshot(ModelPath.model_validate(path), options.transformers_cache, patterns)
            )

        if isinstance(value, list):
            updates[key] = [local(path) for path in value]
        elif value is not None:
            updates[key] = local(value)
    return settings.model_copy(update=updates)


def model_folder(model: ModelPath, cache_dir: str | None = None) -> Path:
    """The local checkpoint folder of ``model``: the folder itself, or the snapshot of a Hub
    id's resolved revision (``cache_dir``: mergekit's ``--transformers-cache``)."""
    if Path(model.path).expanduser().exists() or not is_hub_id(model.path):
        return model_dir(model.path)
    return model_dir(_snapshot(model, cache_dir, HUB_PATTERNS))


def _adapter_folder(lora: ModelPath, cache_dir: str | None) -> Path:
    folder = Path(lora.path).expanduser()
    if not folder.exists() and is_hub_id(lora.path):
        folder = _snapshot(lora, cache_dir, ("*.json", "*.safetensors", "*.bin"))
    if not (folder / "adapter_config.json").is_file():
        raise LmcError(
            f"LoRA adapter {str(lora)!r} has no adapter_config.json; give a peft adapter folder "
            "or Hub id"
        )
    return folder.resolve()


def _snapshot(model: ModelPath, cache_dir: str | None, patterns: tuple[str, ...]) -> Path:
    """The snapshot folder of a Hub id at its revision (downloaded where the Hub is reachable)."""
    where = cache_dir or constants.HF_HUB_CACHE
    try:
        return Path(
            snapshot_download(
                model.path,
                revision=model.revision,
                cache_dir=cache_dir,
                allow_patterns=list(patterns),
            )
        )
    except (RepositoryNotFoundError, GatedRepoError):
        raise LmcError(
            f"the Hub has no repository {model.path!r} that this account may read; check the "
            "name, or set HF_TOKEN for a gated or private model"
        ) from None
    except RevisionNotFoundError:
        raise LmcError(
            f"{model.path!r} has no revision {model.revision!r}; name a branch, tag or commit "
            "it has"
        ) from None
    except LocalEntryNotFoundError:
        offline = " (HF_HUB_OFFLINE is set)" if constants.HF_HUB_OFFLINE else ""
        raise LmcError(
            f"{str(model)!r} is not in the Hugging Face cache at {where} and the Hub cannot be "
            f"reached{offline}; download it first (hf download {model.path}"
            f"{'' if model.revision is None else ' --revision ' + model.revision}), point "
            "--transformers-cache or HF_HUB_CACHE at the cache that holds it, or give a local "
            "folder"
        ) from None


def merge_lora(model: Path, adapter: Path, cache: Path, options: MergeOptions) -> Path:
    """``adapter`` merged into ``model`` as mergekit merges a ``model+lora`` reference, kept in
    ``cache`` under a name of both folders (a snapshot folder names its commit): reused when
    there, else built in a staging folder and published when complete. The model's tokenizer
    files travel with it (peft saves only the weights and config)."""
    ref = ModelReference(model=ModelPath(path=str(model)), lora=ModelPath(path=str(adapter)))
    target = cache / f"{ref.model._unique_id()}_{ref.lora._unique_id()}"
    if (target / "config.json").is_file():
        return target
    with staged_folder(target, "keep", complete="config.json") as work:
        try:
            merged = ref.merged(
                cache_dir=str(work),
                trust_remote_code=options.trust_remote_code,
                lora_merge_dtype=options.lora_merge_dtype,
            )
        except (OSError, ValueError, RuntimeError, KeyError) as error:
            first = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise LmcError(
                f"could not merge the LoRA adapter {adapter} into {model}: {first}"
            ) from None
        built = Path(merged.model.path)
        for item in built.iterdir():
            item.rename(work / item.name)
        built.rmdir()
        copy_tagalong_files(model, work)
    return target
