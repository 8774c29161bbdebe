"""Manifest records: the JSON commit marker of one stored object.

A manifest is written only after its object is durable; it names the object, its size and checksum, the
steps it holds and the generation that wrote it. Manifests read back from storage are untrusted input:
:meth:`Manifest.from_json` validates every field (types, ranges, that the object key is a plain name under
``objects/``) before anything uses it.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ray_ckpt.errors import RayCkptError
from ray_ckpt.lineage import layout

MAX_OBJECT_BYTES = 1 << 46  # 64 TiB: anything larger is refused as absurd
MAX_STEP = 10**12 - 1
MAX_MANIFEST_BYTES = 1 << 20  # a manifest is a few hundred bytes; its info dict stays small


#: the checksum algorithms a manifest may name (those of :mod:`ray_ckpt.format.checksum`; the lineage layer
#: imports nothing outside itself)
CRC_ALGORITHMS = ("crc32", "crc32c")


class ManifestError(RayCkptError, ValueError):
    """A manifest is malformed or hostile. Names the manifest."""


@dataclass(frozen=True, kw_only=True)
class Manifest:
    kind: str                 #: "full" or "diff"
    generation: int           #: the attach that wrote it
    first_step: int           #: first step held (== last_step for a full)
    last_step: int            #: last step held
    object: str               #: storage key of the data object
    nbytes: int               #: exact size of the data object
    crc32: int                #: checksum of the whole data object, of algorithm ``crc_alg``
    strategy: str = "lowdiff" #: capture strategy that produced it
    created: float = field(default_factory=time.time)
    info: dict = field(default_factory=dict)  #: small free-form facts (world size, model bytes, ...)
    format: int = 1           #: raised to what the manifest needs (2 with ``crc_alg="crc32c"``)
    #: the algorithm of ``crc32`` (:mod:`ray_ckpt.format.checksum`): ``"crc32"`` (zlib; every manifest written
    #: before CRC-32C has no such field) or ``"crc32c"``
    crc_alg: str = "crc32"

    def __post_init__(self):
        # a version before CRC-32C refuses a format-2 manifest with "upgrade ray_ckpt" (instead of a checksum
        # mismatch), and still reads a CRC-32 one
        if self.crc_alg != "crc32" and self.format < 2:
            object.__setattr__(self, "format", 2)

    @property
    def name(self) -> str:
        if self.kind == "full":
            return layout.full_name(self.generation, self.last_step)
        return layout.diff_name(self.generation, self.first_step, self.last_step)

    @property
    def key(self) -> str:
        return layout.manifest_key(self.name)

    def to_json(self) -> bytes:
        d = asdict(self)
        if d["crc_alg"] == "crc32":   # as versions before CRC-32C wrote it (they refuse unknown fields)
            del d["crc_alg"]
        return json.dumps(d, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, source: str = "<manifest>") -> "Manifest":
        try:
            if len(data) > MAX_MANIFEST_BYTES:
                raise ValueError(f"{len(data)} bytes exceed the {MAX_MANIFEST_BYTES}-byte limit")
            d = json.loads(data)
        except RecursionError:   # checksummed but nested absurdly deep: malformed, not a crash
            raise ManifestError(f"manifest {source!r} is nested too deeply") from None
        except (ValueError, UnicodeDecodeError, TypeError) as e:
            raise ManifestError(f"manifest {source!r} is not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise ManifestError(f"manifest {source!r} is not an object")
        allowed = {"kind", "generation", "first_step", "last_step", "object", "nbytes", "crc32", "strategy",
                   "created", "info", "format", "crc_alg"}
        unknown = set(d) - allowed
        if unknown:
            raise ManifestError(f"manifest {source!r} has unknown fields {sorted(unknown)[:5]}")

        def integer(k: str, lo: int, hi: int) -> int:
            v = d.get(k)
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                raise ManifestError(f"manifest {source!r}: field {k!r} = {v!r:.40} is not an integer in [{lo}, {hi}]")
            return v

        kind = d.get("kind")
        if kind not in ("full", "diff"):
            raise ManifestError(f"manifest {source!r}: unknown kind {kind!r:.40}")
        fmt = integer("format", 1, 10**6)
        if fmt > layout.FORMAT_VERSION:
            raise ManifestError(f"manifest {source!r} has format {fmt}; this ray_ckpt reads up to "
                                f"{layout.FORMAT_VERSION} (upgrade ray_ckpt)")
        m = cls(kind=kind, generation=integer("generation", 0, 999_999),
                first_step=integer("first_step", 0, MAX_STEP), last_step=integer("last_step", 0, MAX_STEP),
                object=d.get("object"), nbytes=integer("nbytes", 0, MAX_OBJECT_BYTES),
                crc32=integer("crc32", 0, 2**32 - 1), strategy=d.get("strategy", "lowdiff"),
                created=d.get("created", 0.0), info=d.get("info", {}), format=fmt,
                crc_alg=d.get("crc_alg", "crc32"))
        if m.crc_alg not in CRC_ALGORITHMS:
            raise ManifestError(f"manifest {source!r}: unknown checksum algorithm {m.crc_alg!r:.40}")
        if not isinstance(m.object, str) or not layout.OBJECT_KEY_RE.match(m.object):
            raise ManifestError(f"manifest {source!r}: object key {m.object!r:.80} is not a plain name under "
                                f"{layout.OBJECTS_DIR!r}")
        if m.object != layout.object_key(m.name):
            raise ManifestError(f"manifest {source!r}: object key {m.object!r} does not match its steps")
        if m.first_step > m.last_step or (kind == "full" and m.first_step != m.last_step):
            raise ManifestError(f"manifest {source!r}: bad step range {m.first_step}..{m.last_step}")
        if not isinstance(m.strategy, str) or len(m.strategy) > 64:
            raise ManifestError(f"manifest {source!r}: bad strategy")
        if not isinstance(m.created, (int, float)) or not isinstance(m.info, dict):
            raise ManifestError(f"manifest {source!r}: bad created/info fields")
        if source != "<manifest>" and source.startswith(layout.MANIFESTS_DIR) and source != m.key:
            raise ManifestError(f"manifest {source!r} describes {m.key!r}")
        return m

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


#: ``durable_diffs`` modes whose diffs the durable tier gets only when needed (written by the workers on flush,
#: under memory pressure, or when a chunk's second copy is missing); "amber" adds the replica's Amber tier
LAZY_DURABLE_DIFFS = ("fulls", "amber")


def lazy_diffs(m: "Manifest") -> bool:
    """A diff of a run whose durable tier holds the fulls (not every step record): ``durable_diffs`` "fulls" or
    "amber" in the manifest's info."""
    return m.kind == "diff" and m.info.get("durable_diffs") in LAZY_DURABLE_DIFFS
