"""The Python code blocks of README.md and docs/*.md as runnable examples, and the names they may rely on.

The names a block may use without defining them (the stand-ins for the reader's own code; README.md says so
next to its first example):

* ``build()`` -> ``(model, optimizer, scheduler)``: a fresh tiny model (:class:`TinyNet`), ``AdamW`` and a
  ``StepLR`` scheduler, seeded, so that every call builds the same state;
* ``build_model()`` -> the model alone (for blocks that wrap it first: DDP, FSDP2, Ray Train's
  ``prepare_model``);
* ``batch(step)`` -> the input of step ``step`` (a deterministic ``(8, 16)`` tensor);
* ``total_steps`` -> 40;
* ``uri`` -> a fresh, empty ``file://`` URI under the test's temporary directory (one per document).

The test also runs every document in a fresh temporary working directory (relative paths land there), with a
one-rank gloo process group while a block builds ``DistributedDataParallel`` or ``fully_shard`` models (what
torchrun or Ray Train set up in a real job), and, for blocks marked ``s3``, against a local moto S3 server.

Directives: an HTML comment on the line before a block's opening fence, ``<!-- docs-test: WORDS -->``:

* ``ray``: the block needs Ray (``runtime="ray"``, Ray Train); it runs in the Ray test, connected to the test
  session's cluster, in order with the document's other ``ray`` blocks (their own namespace);
* ``s3``: the block runs against the moto S3 server: ``s3://bucket/`` is replaced by a fresh bucket and
  ``127.0.0.1:9000`` by the server's endpoint; credentials come from the ``AWS_*`` environment;
* ``skip: REASON``: the block is not run; the test lists it with its reason (keep these few).

Blocks of one document without ``ray`` run in order in one namespace, so a block may use what an earlier one
defined.
"""
from __future__ import annotations

import dataclasses
import re
import traceback
import unicodedata
from pathlib import Path
from urllib.parse import unquote

import torch

ROOT = Path(__file__).resolve().parent.parent
TOTAL_STEPS = 40
_DIRECTIVE = re.compile(r"^\s*<!--\s*docs-test:\s*(.*?)\s*-->\s*$")
_RAY_HINTS = re.compile(r'runtime\s*=\s*"ray"|ray_ckpt\.train|TorchTrainer|^\s*import ray\b|^\s*from ray\b', re.M)


# ---------------------------------------------------------------------------------------------------------
# The names the blocks rely on
# ---------------------------------------------------------------------------------------------------------
class TinyNet(torch.nn.Module):
    """Two blocks and a head: small enough for a test, with ``model.blocks`` as FSDP2 examples expect."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU())
                                           for _ in range(2)])
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_model() -> torch.nn.Module:
    """A fresh :class:`TinyNet`, seeded: every call gives the same parameters."""
    torch.manual_seed(0)
    return TinyNet()


def build():
    """``(model, optimizer, scheduler)``: :func:`build_model`, AdamW and StepLR (step size 10)."""
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)
    return model, optimizer, scheduler


def batch(step: int) -> torch.Tensor:
    """The input of step ``step``: the same tensor for the same step in every process."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, 16, generator=g)


def namespace(uri: str) -> dict:
    """A document's namespace: the names above, and ``__name__`` set so that functions defined in a block are
    pickled by value (Ray ships them to its workers)."""
    return {"__name__": "__docs__", "build": build, "build_model": build_model, "batch": batch,
            "total_steps": TOTAL_STEPS, "uri": uri}


# ---------------------------------------------------------------------------------------------------------
# Extraction
# ---------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Block:
    doc: str            #: path relative to the repository root, e.g. "docs/amber.md"
    line: int           #: 1-based line of the first code line (the one after the opening fence)
    code: str
    directives: dict    #: {"ray": True, "s3": True, "skip": "reason"}

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def ray(self) -> bool:
        return "ray" in self.directives

    @property
    def skip(self) -> str | None:
        return self.directives.get("skip")


def documents() -> list[Path]:
    """README.md and every guide under docs/."""
    return [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


def _parse_directive(text: str) -> dict:
    out: dict = {}
    for part in (p.strip() for p in text.split(";")):
        if not part:
            continue
        key, _, value = part.partition(":")
        key = key.strip()
        if key not in ("ray", "s3", "skip"):
            raise ValueError(f"unknown docs-test directive {part!r}")
        if key == "skip" and not value.strip():
            raise ValueError("a docs-test skip needs a reason: <!-- docs-test: skip: why -->")
        out[key] = value.strip() if key == "skip" else True
    return out


def extract(path: Path, text: str | None = None) -> list[Block]:
    """Every ```python block of ``path`` (or of ``text``, named after ``path``), with its directives."""
    lines = (path.read_text() if text is None else text).split("\n")
    doc = _rel(path)
    blocks, i = [], 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            lang = line[3:].strip()
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            if j == len(lines):
                raise ValueError(f"{doc}:{i + 1}: code fence never closed")
            if lang == "python":
                prev = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
                m = _DIRECTIVE.match(prev)
                directives = _parse_directive(m.group(1)) if m else {}
                blocks.append(Block(doc, i + 2, "\n".join(lines[i + 1:j]), directives))
            i = j + 1
        else:
            i += 1
    return blocks


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def unmarked_ray_blocks(blocks: list[Block]) -> list[str]:
    """Blocks that use Ray without the ``ray`` directive (they would start Ray in the fast test)."""
    return [b.where for b in blocks if not b.ray and not b.skip and _RAY_HINTS.search(b.code)]


# ---------------------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------------------
class DocsExampleError(AssertionError):
    """A block failed: the message names the document and the line of the failing statement."""


def run_block(block: Block, ns: dict, substitutions: dict | None = None) -> None:
    """Execute ``block`` in ``ns``; on any exception raise :class:`DocsExampleError` naming ``doc:line``."""
    code = block.code
    for old, new in (substitutions or {}).items():
        code = code.replace(old, new)
    filename = str(ROOT / block.doc)
    try:
        compiled = compile("\n" * (block.line - 1) + code, filename, "exec")
        exec(compiled, ns)  # noqa: S102 - the documentation's own examples
    except Exception as e:  # noqa: BLE001 - reported with the document's line
        line = getattr(e, "lineno", None) if isinstance(e, SyntaxError) else None
        for frame in traceback.extract_tb(e.__traceback__):
            if frame.filename == filename:
                line = frame.lineno      # the innermost line of the document (a call inside a def counts)
        where = f"{block.doc}:{line or block.line}"
        raise DocsExampleError(f"{where}: the example in {block.doc} (block at line {block.line}) failed: "
                               f"{type(e).__name__}: {e}") from e


# ---------------------------------------------------------------------------------------------------------
# Links
# ---------------------------------------------------------------------------------------------------------
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (``-`` and ``_`` kept), spaces to ``-``."""
    text = heading.strip().lower()
    text = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return text.replace(" ", "-")


def _strip_code(lines: list[str]) -> list[str]:
    """The lines outside fenced code, with inline code spans blanked out."""
    out, fence = [], False
    for line in lines:
        if line.startswith("```"):
            fence = not fence
            out.append("")
            continue
        out.append("" if fence else re.sub(r"`[^`]*`", "``", line))
    return out


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of ``path`` (a repeated heading gets ``-1``, ``-2``...)."""
    seen: dict[str, int] = {}
    out, fence = set(), False
    for line in path.read_text().split("\n"):
        if line.startswith("```"):
            fence = not fence
        m = None if fence else re.match(r"^#{1,6}\s+(.*)$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(path: Path) -> list[str]:
    """Relative links of ``path`` whose file or anchor does not exist, as ``doc:line: target (why)``."""
    out = []
    for n, line in enumerate(_strip_code(path.read_text().split("\n")), start=1):
        for m in _LINK.finditer(line):
            target = m.group(1)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):   # http:, https:, mailto: ...
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / unquote(file_part)).resolve() if file_part else path.resolve()
            if not dest.exists():
                out.append(f"{_rel(path)}:{n}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                out.append(f"{_rel(path)}:{n}: {target} (no such heading in {_rel(dest)})")
    return out
