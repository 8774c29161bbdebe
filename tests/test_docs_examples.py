"""The documentation's Python examples run, and its links resolve.

Every ```python block of README.md and docs/*.md is executed (local ``file://`` URIs under the test's temporary
directory, a tiny model). The contract, in full, is in :mod:`tests._docs_blocks`; in short, a block may use
without defining them:

* ``build()`` -> ``(model, optimizer, scheduler)`` (a tiny two-block model, AdamW, StepLR), ``build_model()``,
  ``batch(step)`` (the step's input), ``total_steps`` (40) and ``uri`` (a fresh ``file://`` URI per document);
* a fresh working directory; a one-rank gloo process group while a block builds DDP or FSDP2 models;
* ``<!-- docs-test: ray -->`` before a block: it runs in the Ray test (the session's 2-node cluster);
  ``<!-- docs-test: s3 -->``: against the moto S3 server (``s3://bucket/`` -> a fresh bucket,
  ``127.0.0.1:9000`` -> its endpoint); ``<!-- docs-test: skip: reason -->``: not run, listed here.

Blocks of one document run in order in one namespace (the ``ray`` ones in their own).
"""
from __future__ import annotations

import os
import re
import uuid
import warnings
from pathlib import Path

import pytest

from tests import _docs_blocks as D

MAX_SKIPS = 3
_DIST_HINT = re.compile(r"DistributedDataParallel\(|fully_shard\(")

_DOCS = {D._rel(p): D.extract(p) for p in D.documents()}
_LOCAL = [doc for doc, blocks in _DOCS.items() if any(not b.ray and not b.skip for b in blocks)]
# a Ray block repeated verbatim in a later document (the README's Ray Train loop is also the guide's) runs once,
# in the first document that has it: each run of a TorchTrainer costs over a minute here
_RAY_BLOCKS: dict[str, list] = {}
_seen_ray_code: set[str] = set()
for _doc, _blocks in _DOCS.items():
    _mine = [b for b in _blocks if b.ray and not b.skip and b.code not in _seen_ray_code]
    _seen_ray_code.update(b.code for b in _mine)
    if _mine:
        _RAY_BLOCKS[_doc] = _mine
_RAY = list(_RAY_BLOCKS)
_SKIPPED = [b for blocks in _DOCS.values() for b in blocks if b.skip]


def _marks(doc: str) -> list:
    return [pytest.mark.s3] if any("s3" in b.directives and not b.ray for b in _DOCS[doc]) else []


class _ProcessGroup:
    """A one-rank gloo process group, created the first time a block needs one, destroyed at the end."""

    def __init__(self, tmp_path: Path):
        self.tmp_path = tmp_path
        self.created = False

    def ensure(self) -> None:
        import torch.distributed as dist
        if self.created or dist.is_initialized():
            return
        dist.init_process_group("gloo", init_method=(self.tmp_path / "pg").as_uri(), rank=0, world_size=1)
        self.created = True

    def close(self) -> None:
        import torch.distributed as dist

        from tests import _training as T
        if self.created and dist.is_initialized():
            T.close_dist()


def run_document(blocks: list[D.Block], tmp_path: Path, monkeypatch, *, s3_server=None) -> int:
    """Run ``blocks`` in order in one namespace (cwd: a fresh directory); returns how many ran."""
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    monkeypatch.chdir(work)
    ns = D.namespace((tmp_path / "ckpt").as_uri())
    group = _ProcessGroup(tmp_path)
    ran = 0
    try:
        for i, block in enumerate(blocks):
            subs = None
            if "s3" in block.directives:
                assert s3_server is not None, f"{block.where}: an s3 block needs the s3_server fixture"
                bucket = s3_server.make_bucket(f"docs-{block.line}-{uuid.uuid4().hex[:12]}")
                subs = {"s3://bucket/": bucket + "/", "127.0.0.1:9000": s3_server.endpoint}
                for k, v in {"AWS_ACCESS_KEY_ID": s3_server.options["access_key"],
                             "AWS_SECRET_ACCESS_KEY": s3_server.options["secret_key"],
                             "AWS_DEFAULT_REGION": s3_server.options["region"]}.items():
                    monkeypatch.setenv(k, v)
            if _DIST_HINT.search(block.code):
                group.ensure()
            D.run_block(block, ns, subs)
            ran += 1
    finally:
        group.close()
        for obj in list(ns.values()):   # a block that raised may leave a writer attached: release it
            close = getattr(obj, "close", None)
            if type(obj).__name__ in ("Checkpointer", "TrainSession") and callable(close):
                try:
                    close()
                except Exception:  # noqa: BLE001 - the block's own error is the one to report
                    pass
    return ran


# ---------------------------------------------------------------------------------------------------------
# The examples
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("doc", [pytest.param(d, marks=_marks(d)) for d in _LOCAL])
def test_examples_run(doc, tmp_path, monkeypatch, request):
    blocks = [b for b in _DOCS[doc] if not b.ray and not b.skip]
    s3 = request.getfixturevalue("s3_server") if any("s3" in b.directives for b in blocks) else None
    assert run_document(blocks, tmp_path, monkeypatch, s3_server=s3) == len(blocks)


@pytest.mark.ray
@pytest.mark.parametrize("doc", _RAY)
def test_ray_examples_run(doc, tmp_path, monkeypatch, ray_cluster):
    import ray

    from ray_ckpt.runtime import naming
    from ray_ckpt.runtime.coordinator import shutdown_run

    def runs() -> set[str]:
        names = {(a["name"] if isinstance(a, dict) else a) for a in ray.util.list_named_actors(all_namespaces=True)}
        return {n[len("ray_ckpt:"):-len(":coordinator")] for n in names
                if n.startswith("ray_ckpt:") and n.endswith(":coordinator")}

    # Ray Train's own files (RunConfig.storage_path unset: ~/ray_results, read when a RunConfig is built) go below
    # the test's directory
    import ray.train.constants
    monkeypatch.setattr(ray.train.constants, "DEFAULT_STORAGE_PATH", str(tmp_path / "ray_results"))
    before = runs()
    blocks = _RAY_BLOCKS[doc]
    try:
        assert run_document(blocks, tmp_path, monkeypatch) == len(blocks)
    finally:
        for run in runs() - before:
            shutdown_run(run)


def test_skipped_examples_are_few_and_listed():
    """Every skipped block is listed (printed, and a warning each in pytest's summary); at most MAX_SKIPS."""
    listed = [f"{b.where}: {b.skip}" for b in _SKIPPED]
    print(f"{len(listed)} skipped example(s)", *listed, sep="\n  ")
    for item in listed:
        warnings.warn(f"docs example not run: {item}", UserWarning, stacklevel=1)
    assert len(listed) <= MAX_SKIPS, listed


def test_every_document_has_runnable_examples_marked_correctly():
    """A block that uses Ray carries the ``ray`` directive (else it would start Ray in the fast tier), and the
    README and the main guides hold examples at all (an extraction that finds nothing must not pass)."""
    everything = [b for blocks in _DOCS.values() for b in blocks]
    assert D.unmarked_ray_blocks(everything) == []
    for doc in ("README.md", "docs/ray-train.md", "docs/amber.md", "docs/sharded.md", "docs/cli.md"):
        assert _DOCS.get(doc), f"{doc}: no python examples found"


# ---------------------------------------------------------------------------------------------------------
# Links
# ---------------------------------------------------------------------------------------------------------
def test_relative_links_resolve():
    broken = [err for p in D.documents() for err in D.broken_links(p)]
    assert broken == [], "\n".join(broken)


def test_readme_links_every_guide():
    readme = (D.ROOT / "README.md").read_text()
    missing = [p.name for p in sorted((D.ROOT / "docs").glob("*.md")) if f"(docs/{p.name}" not in readme]
    assert missing == [], f"README.md does not link {missing}"


# ---------------------------------------------------------------------------------------------------------
# Tests of the runner and the link check: they fail when an example or a link is broken
# ---------------------------------------------------------------------------------------------------------
def _readme_loop() -> D.Block:
    return next(b for b in _DOCS["README.md"] if "ray_ckpt.Checkpointer(" in b.code and not b.ray)


def test_a_broken_call_fails_naming_the_document_and_line(tmp_path, monkeypatch):
    block = _readme_loop()
    assert "full_every=" in block.code
    broken = D.Block(block.doc, block.line, block.code.replace("full_every=", "full_evry=", 1), {})
    offset = next(i for i, line in enumerate(broken.code.split("\n")) if "full_evry=" in line)
    call = next(i for i in range(offset, -1, -1) if "Checkpointer(" in broken.code.split("\n")[i])
    with pytest.raises(D.DocsExampleError) as e:
        run_document([broken], tmp_path, monkeypatch)
    message = str(e.value)
    assert message.startswith(f"README.md:{block.line + call}:"), message
    assert "full_evry" in message and "TypeError" in message


def test_a_failure_inside_a_function_names_its_line(tmp_path, monkeypatch):
    block = D.Block("docs/x.md", 10, "def f():\n    return undefined_name\n\nf()", {})
    with pytest.raises(D.DocsExampleError, match=r"^docs/x\.md:11: .*NameError"):
        run_document([block], tmp_path, monkeypatch)


def test_the_unbroken_block_passes(tmp_path, monkeypatch):
    """The same block as above, unchanged: what fails there is the broken keyword, not the set-up."""
    assert run_document([_readme_loop()], tmp_path, monkeypatch) == 1


def test_extraction_reads_directives_and_lines(tmp_path):
    md = tmp_path / "x.md"
    md.write_text("# T\n\n<!-- docs-test: ray -->\n```python\na = 1\n```\n\n```bash\nls\n```\n"
                  "<!-- docs-test: skip: needs a GPU -->\n\n```python\nb = 2\n```\n")
    blocks = D.extract(md)
    assert [(b.line, b.code, b.directives) for b in blocks] == [
        (5, "a = 1", {"ray": True}), (14, "b = 2", {"skip": "needs a GPU"})]
    with pytest.raises(ValueError, match="reason"):
        D.extract(md, "<!-- docs-test: skip -->\n```python\nx\n```\n")


def test_unmarked_ray_blocks_are_found():
    blocks = [D.Block("d.md", 1, 'ck = ray_ckpt.Checkpointer(uri, m, o, runtime="ray")', {}),
              D.Block("d.md", 5, "import ray\nray.init(address=\"local\")", {}),
              D.Block("d.md", 9, 'ray_ckpt.Checkpointer(uri, m, o, runtime="ray")', {"ray": True}),
              D.Block("d.md", 12, "ck = ray_ckpt.Checkpointer(uri, m, o)", {})]
    assert D.unmarked_ray_blocks(blocks) == ["d.md:1", "d.md:5"]


def test_broken_links_are_found(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A title\n\n## Second `part`\n")
    md = tmp_path / "README.md"
    md.write_text("[ok](docs/a.md) [ok](docs/a.md#second-part) [ok](#top) [web](https://x.org/y)\n"
                  "# Top\n`[not a link](nowhere.md)`\n"
                  "[gone](docs/b.md) [bad anchor](docs/a.md#third)\n")
    assert D.broken_links(md) == [
        f"{md}:4: docs/b.md (no such file)",
        f"{md}:4: docs/a.md#third (no such heading in {tmp_path / 'docs' / 'a.md'})",
    ]
