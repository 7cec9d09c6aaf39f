"""A file too large for one trip, brought in numbered parts and joined where it is used.

A lent GPU machine reaches no package index, and each run carries at most 64 MiB of files, the
repository included; the target's Q4_1 GGUF (98,362,432 bytes) is larger. So it is cut here into
N parts (:func:`split`), one run carries each part, and every run copies what it carries into a
store that outlives the run on the same machine (:func:`store`). Once all N are there,
:func:`join` writes the file and checks its sha256 (``target_setup.GGUF_SHA256``) before anything
reads it.

A part is named ``gguf-part-<i>-of-<n>.<first 16 hex of its sha256>``, so a store knows how many
parts make the file, which are missing, and whether a part arrived damaged, without any other
file travelling. Errors are :class:`PartError` (a ``ValueError``) naming the part or the digests.

Usage::

    python -m dflash_app.gguf_parts split FILE OUT_DIR [--part-mib 38]
    python -m dflash_app.gguf_parts store --store DIR PATH...   # parts, or folders holding them
    python -m dflash_app.gguf_parts join --store DIR --out FILE [--sha256 HEX]

``join`` exits 3 when parts are missing (it names them), 1 on a damaged part or a wrong digest.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from pathlib import Path

from dflash.train.target_setup import GGUF_SHA256, file_sha256

PREFIX = "gguf-part-"
_NAME = re.compile(rf"{PREFIX}(\d+)-of-(\d+)\.([0-9a-f]{{16}})")
INCOMPLETE = 3          # join's exit status while parts are missing


class PartError(ValueError):
    """A part that is damaged or foreign, parts of two different splits, or a joined file whose
    digest is not the expected one."""


class MissingParts(PartError):
    """Some parts are not in the store yet; ``missing`` holds their numbers (1-based)."""

    def __init__(self, missing: list[int], n: int | None):
        self.missing, self.n = missing, n
        what = ", ".join(map(str, missing)) if n else "all (no part stored yet)"
        super().__init__(f"missing parts: {what}" + (f" (of {n})" if n else ""))


def part_name(i: int, n: int, sha256: str) -> str:
    return f"{PREFIX}{i}-of-{n}.{sha256[:16]}"


def parse(name: str) -> tuple[int, int, str] | None:
    """``(i, n, digest16)`` of a part's file name, or None for another file."""
    m = _NAME.fullmatch(name)
    return (int(m[1]), int(m[2]), m[3]) if m else None


def split(src: str | Path, out_dir: str | Path, part_bytes: int) -> list[Path]:
    """Cut ``src`` into ceil(size / part_bytes) parts in ``out_dir`` (earlier parts there are
    removed first). Returns the parts in order. Raises ``ValueError`` for ``part_bytes`` < 1."""
    if part_bytes < 1:
        raise ValueError(f"part_bytes: {part_bytes} (must be >= 1)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob(PREFIX + "*"):
        old.unlink()
    size = Path(src).stat().st_size
    n = max(1, -(-size // part_bytes))
    parts = []
    with open(src, "rb") as f:
        for i in range(1, n + 1):
            tmp = out / f".part{i}.tmp"
            tmp.write_bytes(f.read(part_bytes))
            parts.append(tmp.rename(out / part_name(i, n, file_sha256(tmp))))
    return parts


def _checked(path: Path) -> tuple[int, int]:
    """``(i, n)`` of a part whose content matches its name; ``PartError`` otherwise."""
    got = parse(path.name)
    if got is None:
        raise PartError(f"{path}: not a part name ({PREFIX}<i>-of-<n>.<sha256 prefix>)")
    i, n, digest = got
    if not 1 <= i <= n:
        raise PartError(f"{path.name}: part {i} of {n}")
    if file_sha256(path)[:16] != digest:
        raise PartError(f"{path.name}: content does not match its sha256 prefix (damaged in transit)")
    return i, n


def store(paths: list[str | Path], store_dir: str | Path) -> list[Path]:
    """Copy the parts found at ``paths`` (files, or folders searched recursively) into
    ``store_dir``, each checked against its name; a part already stored is kept. Returns the
    parts copied now. Raises ``PartError`` for a damaged part."""
    dest = Path(store_dir)
    dest.mkdir(parents=True, exist_ok=True)
    found: list[Path] = []
    for p in map(Path, paths):
        found += sorted(p.rglob(PREFIX + "*")) if p.is_dir() else [p] if p.exists() else []
    copied = []
    for part in found:
        if parse(part.name) is None:
            continue
        _checked(part)
        target = dest / part.name
        if target.is_file() and target.stat().st_size == part.stat().st_size:
            continue
        tmp = dest / (part.name + ".tmp")
        shutil.copyfile(part, tmp)
        copied.append(tmp.rename(target))
    return copied


def stored_parts(store_dir: str | Path) -> tuple[int | None, dict[int, Path]]:
    """``(n, {i: path})`` of the parts in the store (n None when it holds none). Raises
    ``PartError`` when it holds parts of two different splits."""
    parts: dict[int, Path] = {}
    counts = set()
    for p in sorted(Path(store_dir).glob(PREFIX + "*")):
        got = parse(p.name)
        if got:
            parts[got[0]] = p
            counts.add(got[1])
    if len(counts) > 1:
        raise PartError(f"{store_dir}: parts of splits into {sorted(counts)} parts; empty it and "
                        f"send one split's parts")
    return (counts.pop() if counts else None), parts


def missing(store_dir: str | Path) -> tuple[int | None, list[int]]:
    """``(n, numbers of the parts not stored yet)``; ``(None, [])`` for an empty store."""
    n, parts = stored_parts(store_dir)
    return n, [i for i in range(1, (n or 0) + 1) if i not in parts]


def join(store_dir: str | Path, out: str | Path, sha256: str = GGUF_SHA256) -> Path:
    """Join the stored parts into ``out`` (atomically) and check it.

    An ``out`` that already has the expected digest is kept. Raises :class:`MissingParts`
    naming the parts not stored yet, or ``PartError`` when a part is damaged or the joined
    file's sha256 is not ``sha256`` (``out`` is then not written)."""
    out = Path(out)
    if out.is_file() and file_sha256(out) == sha256:
        return out
    n, parts = stored_parts(store_dir)
    gaps = [i for i in range(1, (n or 0) + 1) if i not in parts]
    if n is None or gaps:
        raise MissingParts(gaps, n)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "wb") as dst:
        for i in range(1, n + 1):
            _checked(parts[i])
            with open(parts[i], "rb") as src:
                shutil.copyfileobj(src, dst, 1 << 20)
    got = file_sha256(tmp)
    if got != sha256:
        tmp.unlink()
        raise PartError(f"joined {n} parts from {store_dir}: sha256 {got} != expected {sha256}")
    return tmp.rename(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash_app.gguf_parts",
                                 description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("split", help="cut FILE into parts in OUT_DIR")
    p.add_argument("file")
    p.add_argument("out_dir")
    p.add_argument("--part-mib", type=float, default=38.0)
    p = sub.add_parser("store", help="copy the parts found at PATHs into the store")
    p.add_argument("--store", required=True)
    p.add_argument("paths", nargs="*")
    p = sub.add_parser("join", help="join the stored parts and check the digest")
    p.add_argument("--store", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--sha256", default=GGUF_SHA256)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "split":
            for part in split(args.file, args.out_dir, int(args.part_mib * (1 << 20))):
                print(part)
        elif args.cmd == "store":
            for part in store(args.paths, args.store):
                print(f"[gguf_parts] stored {part.name}")
            n, gaps = missing(args.store)
            have = (n or 0) - len(gaps)
            print(f"[gguf_parts] {have} of {n or '?'} parts stored" +
                  (f"; missing parts: {', '.join(map(str, gaps))}" if gaps else ""))
        else:
            print(f"[gguf_parts] joined {join(args.store, args.out, args.sha256)} (sha256 ok)")
    except MissingParts as e:
        print(f"[gguf_parts] {e}", file=sys.stderr)
        return INCOMPLETE
    except PartError as e:
        print(f"[gguf_parts] error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
