"""Reading the committed lineage from storage (with the lineage index when there is one) and keeping that index
honest after an out-of-order commit. Apart from :mod:`ray_ckpt.engine.restore` because the persistence actors need
exactly this and nothing of the tensor side: they import neither torch nor the codecs (see
``tests/test_layering.py``). Runs in any process.
"""
from __future__ import annotations

import functools
import logging

from ray_ckpt.lineage import MANIFESTS_DIR, Lineage, Manifest, ManifestError
from ray_ckpt.lineage import index as lineage_index
from ray_ckpt.lineage import retention
from ray_ckpt.lineage.layout import INDEX_KEY
from ray_ckpt.storage import ObjectNotFound, StorageError

log = logging.getLogger("ray_ckpt")


def load_lineage(storage, *, strict: bool = True, use_index: bool = True) -> tuple[Lineage, list[str]]:
    """Every committed manifest. Malformed ones raise :class:`ManifestError` when ``strict``; otherwise
    they are skipped and their keys returned as the second element.

    With ``use_index`` the lineage index (:mod:`ray_ckpt.lineage.index`) is read first and only the manifests
    committed after it are listed and read: a bounded number of requests however long the run. Without an
    index (or with a broken one) every manifest is listed and read. The lineage's retention record
    (:mod:`ray_ckpt.lineage.retention`) is read only if a step asked for is not recoverable, to say why."""
    if use_index:
        got = _load_indexed(storage, strict)
        if got is not None:
            return got
    return _load_listed(storage, storage.list(MANIFESTS_DIR), strict, [])


def _load_listed(storage, keys, strict: bool, manifests: list) -> tuple[Lineage, list[str]]:
    bad = []
    for key in keys:
        if not key.endswith(".json"):
            continue
        try:
            manifests.append(Manifest.from_json(storage.read(key), key))
        except ObjectNotFound:
            continue  # deleted (garbage-collected) between the listing and the read
        except ManifestError:
            if strict:
                raise
            bad.append(key)
    return Lineage(_dedupe(manifests), retention=functools.partial(retention.read, storage)), bad


def _dedupe(manifests: list) -> list:
    by_name = {}
    for m in manifests:  # later entries (read from storage) win over the index's copies
        by_name[m.name] = m
    return list(by_name.values())


def _load_indexed(storage, strict: bool) -> tuple[Lineage, list[str]] | None:
    try:
        data = storage.read(INDEX_KEY)
    except ObjectNotFound:
        return None
    except StorageError as e:
        log.warning("ray_ckpt: lineage index unreadable (%s); listing every manifest", e)
        return None
    try:
        gen, marks, manifests = lineage_index.decode_index(data)
    except lineage_index.IndexError_ as e:
        log.warning("ray_ckpt: %s; listing every manifest", e)
        return None
    newer = lineage_index.newer_keys(storage, gen, marks)
    lineage, bad = _load_listed(storage, newer, strict, list(manifests))
    fresh = {k.rsplit("/", 1)[-1][:-len(".json")] for k in newer}
    lineage.from_index = {m.name for m in manifests} - fresh  # copies: checked against storage by plan_restore
    return lineage, bad


def unhide(storage, m: Manifest) -> bool:
    """After committing ``m`` possibly out of order: delete the lineage index when it would hide ``m`` from
    readers (:func:`ray_ckpt.lineage.index.hides`); they list every manifest until the next index. Returns
    whether it deleted it. Any process that commits (the persistence workers, the replica)."""
    try:
        index = lineage_index.decode_index(storage.read(INDEX_KEY))
    except (ObjectNotFound, lineage_index.IndexError_):
        return False      # readers list every manifest already
    except StorageError as e:
        log.warning("ray_ckpt: lineage index unreadable after committing %s (%s); deleting it", m.name, e)
        index = None
    if index is not None and not lineage_index.hides(index, m):
        return False
    storage.delete(INDEX_KEY)
    log.info("ray_ckpt: %s was committed behind the lineage index; index deleted (readers list until the next)",
             m.name)
    return True
