"""Sampler: exact mid-epoch resume, one global order for every world size; prepare writes real token files."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, train

from dettrain.data import (
    BYTE_EOT,
    DataConfig,
    SampleDataset,
    StepSampler,
    epoch_order,
    load_tokens,
    stdlib_corpus,
)
from dettrain.record.ledger import read_ledger


@pytest.fixture(scope="module")
def ds():
    return SampleDataset(stdlib_corpus(200_000), seq_len=32)


def steps_of(sampler: StepSampler, n: int) -> list[list[tuple[int, torch.Tensor]]]:
    it = iter(sampler)
    return [[(mb.index, mb.tokens) for mb in next(it)] for _ in range(n)]


def test_global_order_is_the_same_for_world_sizes_1_2_4(ds):
    # 40 steps of 16 samples: crosses the epoch boundary (6,249 samples / 16 = 390 steps per epoch... not here),
    # so use a small dataset slice to cross it too
    small = SampleDataset(ds.tokens[: 32 * 70 + 1], 32)  # 70 samples: 4 steps of 16 per epoch
    ref = None
    for world in (1, 2, 4):
        per_rank = [steps_of(StepSampler(small, 5, 16, 2, rank=r, world=world), 10) for r in range(world)]
        # reassemble every step's global batch from the ranks' micro-batches, by global micro-batch index
        glob = []
        for s in range(10):
            mbs = sorted((i, t) for r in range(world) for i, t in per_rank[r][s])
            assert [i for i, _ in mbs] == list(range(8))
            glob.append(torch.cat([t for _, t in mbs]))
        if ref is None:
            ref = glob
        else:
            assert all(torch.equal(a, b) for a, b in zip(ref, glob)), world


def test_order_depends_on_seed_and_epoch_only(ds):
    assert np.array_equal(epoch_order(1, 0, 1000), epoch_order(1, 0, 1000))
    assert not np.array_equal(epoch_order(1, 0, 1000), epoch_order(2, 0, 1000))
    assert not np.array_equal(epoch_order(1, 0, 1000), epoch_order(1, 1, 1000))


@pytest.mark.parametrize("workers", [0, 2])
def test_exact_mid_epoch_resume(ds, workers):
    small = SampleDataset(ds.tokens[: 32 * 70 + 1], 32)
    full = steps_of(StepSampler(small, 9, 16, 4, rank=1, world=2, num_workers=workers), 11)
    for cut in (3, 4, 6):  # mid-epoch, at the epoch boundary, in the second epoch
        a = StepSampler(small, 9, 16, 4, rank=1, world=2, num_workers=workers)
        steps_of(a, cut)
        state = json.loads(json.dumps(a.state_dict()))  # survives serialisation
        b = StepSampler(small, 9, 16, 4, rank=1, world=2, num_workers=workers)
        b.load_state_dict(state)
        rest = steps_of(b, 11 - cut)
        for got, want in zip(rest, full[cut:]):
            assert [i for i, _ in got] == [i for i, _ in want]
            assert all(torch.equal(x, y) for (_, x), (_, y) in zip(got, want))


def test_state_is_epoch_and_position(ds):
    small = SampleDataset(ds.tokens[: 32 * 70 + 1], 32)
    s = StepSampler(small, 0, 16, 4)
    steps_of(s, 5)
    assert s.state_dict() == {"epoch": 1, "position": 16}  # 4 steps per epoch of 70 samples


def test_embedded_corpus_is_python_source():
    toks = stdlib_corpus(100_000)
    text = bytes(toks[:20000]).decode("utf-8", errors="replace")
    assert "def " in text and "import " in text
    assert np.array_equal(toks, stdlib_corpus(100_000))


def test_the_corpus_files_are_the_rglob_definitions_files(tmp_path, monkeypatch):
    """stdlib_sources walks without entering site-packages; its files and their order are those of the plain
    definition (rglob("*.py") minus anything with site-packages among its parts, sorted by relative path), on the
    real standard library and on a tree with the cases that differ between walkers: site-packages at two depths, a
    symbolic link to a directory, a directory named *.py, hidden files, a broken link."""
    import sysconfig

    from dettrain import data

    def definition(root: Path) -> list[Path]:
        return sorted((q for q in root.rglob("*.py") if "site-packages" not in q.parts),
                      key=lambda q: q.relative_to(root).as_posix())

    real = Path(sysconfig.get_paths()["stdlib"])
    data.stdlib_sources.cache_clear()
    assert list(data.stdlib_sources()) == definition(real) and len(definition(real)) > 500
    root = tmp_path / "lib"
    for rel in ("a.py", "b.txt", "z/c.py", "site-packages/x.py", "z/site-packages/y.py", "z/.hidden.py",
                "d.py/inner.py", "Z/e.py", "outside/o.py"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("x = 1\n")
    (root / "link").symlink_to(root / "outside", target_is_directory=True)
    (root / "broken.py").symlink_to(root / "nowhere.py")
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(root)})
    data.stdlib_sources.cache_clear()
    try:
        assert list(data.stdlib_sources()) == definition(root), (data.stdlib_sources(), definition(root))
    finally:
        data.stdlib_sources.cache_clear()


def prepare_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dettrain.data", "prepare", *map(str, args)], capture_output=True,
                          text=True, cwd=REPO)


def test_prepare_byte_level_roundtrip(tmp_path):
    src = tmp_path / "a.txt"
    src.write_text("hello tokens\n" * 50)
    out = tmp_path / "tok.bin"
    p = prepare_cli(src, "--out", out, "--no-eot")
    assert p.returncode == 0, p.stderr
    toks = load_tokens(DataConfig(path=str(out)))
    assert toks.dtype == np.uint8 and bytes(np.asarray(toks)) == src.read_bytes()
    # by default every document ends with the byte-level end-of-text token 256 (vocabulary 257, uint16)
    p = prepare_cli(src, "--out", out)
    assert p.returncode == 0, p.stderr
    toks = np.asarray(load_tokens(DataConfig(path=str(out))))
    meta = json.loads((tmp_path / "tok.bin.json").read_text())
    assert (meta["vocab_size"], meta["eot_id"], meta["dtype"]) == (257, BYTE_EOT, "uint16")
    assert toks.tolist() == list(src.read_bytes()) + [256]


def test_prepare_walks_directories_in_sorted_order_with_eot_between_documents(tmp_path):
    root = tmp_path / "corpus"
    for rel, text in [("b/2.txt", "two"), ("a.txt", "one"), ("b/10.txt", "ten"), ("c.md", "skip me"),
                      (".git/objects/x.txt", "hidden"), ("b/.cache.txt", "hidden too")]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    extra = tmp_path / "z.txt"
    extra.write_text("last")
    out = tmp_path / "t.bin"
    p = prepare_cli(root, extra, "--out", out, "--glob", "*.txt")
    assert p.returncode == 0, p.stderr
    toks = np.asarray(load_tokens(DataConfig(path=str(out)))).tolist()
    docs = ["one", "ten", "two", "last"]  # a.txt, b/10.txt, b/2.txt (sorted relative paths), then z.txt as given
    assert toks == [t for d in docs for t in [*d.encode(), 256]]
    assert json.loads((tmp_path / "t.bin.json").read_text())["n_documents"] == 4


def test_prepare_with_a_tokenizers_json(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    text = "the quick brown fox jumps over the lazy dog\n" * 200
    src = tmp_path / "t.txt"
    src.write_text(text)
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train([str(src)], trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]", "<|endoftext|>"]))
    tj = tmp_path / "tok.json"
    tok.save(str(tj))
    out = tmp_path / "bpe.bin"
    p = prepare_cli(src, src, "--out", out, "--tokenizer", tj)
    assert p.returncode == 0, p.stderr
    meta = json.loads((tmp_path / "bpe.bin.json").read_text())
    eot = tok.token_to_id("<|endoftext|>")
    assert meta["vocab_size"] == tok.get_vocab_size() and meta["eot_id"] == eot
    ids = np.asarray(load_tokens(DataConfig(path=str(out))))
    one = Tokenizer.from_file(str(tj)).encode(text).ids
    assert ids.tolist() == one + [eot] + one + [eot]


def test_prepare_tokenizer_without_eot_is_exit_2(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    src = tmp_path / "t.txt"
    src.write_text("a b c d\n" * 20)
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train([str(src)], trainers.BpeTrainer(vocab_size=50, special_tokens=["[UNK]"]))
    tok.save(str(tmp_path / "tok.json"))
    p = prepare_cli(src, "--out", tmp_path / "o.bin", "--tokenizer", tmp_path / "tok.json")
    assert p.returncode == 2 and "--eot-token" in p.stderr and "Traceback" not in p.stderr
    p = prepare_cli(src, "--out", tmp_path / "o.bin", "--tokenizer", tmp_path / "tok.json", "--no-eot")
    assert p.returncode == 0, p.stderr


def test_prepare_missing_input_is_exit_2(tmp_path):
    p = prepare_cli(tmp_path / "nope.txt", "--out", tmp_path / "o.bin")
    assert p.returncode == 2 and "nope.txt" in p.stderr


def test_vocab_size_0_comes_from_the_sidecar(tmp_path):
    src = tmp_path / "docs"
    src.mkdir()
    for i in range(3):
        (src / f"{i}.txt").write_text(f"document {i}: " + "some text to learn from. " * 400)
    out = tmp_path / "tok.bin"
    assert prepare_cli(src, "--out", out).returncode == 0
    train(tmp_path / "run", f"data.path={out}", "model.vocab_size=0", "train.steps=2")
    header, steps = read_ledger(tmp_path / "run")
    assert header["config"]["model"]["vocab_size"] == 257 and len(steps) == 2  # recorded resolved
    # no sidecar to read: a clear error naming the key
    (tmp_path / "tok.bin.json").unlink()
    p = train(tmp_path / "run2", f"data.path={out}", "data.dtype=uint16", "model.vocab_size=0", check=False)
    assert p.returncode == 2 and "model.vocab_size=0" in p.stderr and "Traceback" not in p.stderr


def test_too_little_data_names_the_key(ds):
    small = SampleDataset(ds.tokens[: 32 * 5 + 1], 32)
    with pytest.raises(ValueError, match="train.global_batch"):
        StepSampler(small, 0, 16, 4)


# ---- bad token files: a one-line error naming the file and data.dtype (exit 2) ----------------------------
@pytest.mark.parametrize("content,dtype,needle", [
    (b"", "uint8", "is empty (0 bytes)"),
    (b"\x01\x02\x03", "uint16", "has 3 bytes, not a multiple of 2 (data.dtype=uint16"),
    (b"\x01\x02\x03\x04\x05\x06", "uint32", "has 6 bytes, not a multiple of 4 (data.dtype=uint32"),
])
def test_bad_token_file_is_a_clear_error(tmp_path, content, dtype, needle):
    from conftest import train

    tok = tmp_path / "tokens.bin"
    tok.write_bytes(content)
    p = train(tmp_path / "run", f"data.path={tok}", f"data.dtype={dtype}", check=False)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert str(tok) in p.stderr and needle in p.stderr, p.stderr[-2000:]


def test_token_file_with_a_wrong_sidecar_dtype_names_the_sidecar(tmp_path):
    from dettrain.errors import UserError

    tok = tmp_path / "tokens.bin"
    tok.write_bytes(b"\x01\x02\x03")
    (tmp_path / "tokens.bin.json").write_text(json.dumps({"dtype": "uint16"}))
    with pytest.raises(UserError, match=r"data.dtype=uint16 \(from tokens.bin.json\)"):
        load_tokens(DataConfig(path=str(tok)))


def test_a_model_smaller_than_the_files_vocabulary_names_the_fix(tmp_path):
    src = tmp_path / "a.txt"
    src.write_text("some text. " * 2000)
    assert prepare_cli(src, "--out", tmp_path / "t.bin").returncode == 0
    p = train(tmp_path / "run", f"data.path={tmp_path / 't.bin'}", check=False)  # the tiny preset: vocabulary 256
    assert p.returncode == 2 and "model.vocab_size=0" in p.stderr and "257" in p.stderr


# ---- issue 23: the data is part of the run (its fingerprint in the header, checked on resume) ------------------
def test_file_fingerprint_whole_and_sampled(tmp_path):
    """Small files: the sha256 of the whole content (computed here independently with hashlib).  Large files: the
    size and fixed-offset chunks, so a change inside a chunk or of the size is seen and the cost does not grow with
    the file; neither the mtime nor the path counts."""
    import hashlib
    import os
    import shutil

    from dettrain.data import file_fingerprint

    small = tmp_path / "small.bin"
    small.write_bytes(bytes(range(256)) * 10)
    assert file_fingerprint(small) == {"size": 2560, "sha256": hashlib.sha256(small.read_bytes()).hexdigest()}
    big = tmp_path / "big.bin"
    big.write_bytes(np.random.default_rng(0).integers(0, 256, 10_000, dtype=np.uint8).tobytes())
    fp = lambda f: file_fingerprint(f, full_limit=1000, chunks=4, chunk_bytes=16)  # noqa: E731
    ref = fp(big)
    assert set(ref) == {"size", "sampled_sha256", "chunks"} and ref["chunks"] == "4 x 16 bytes"
    os.utime(big, (1, 1))
    shutil.copy(big, tmp_path / "copy.bin")
    assert fp(big) == ref and fp(tmp_path / "copy.bin") == ref
    raw = bytearray(big.read_bytes())
    for off in (0, (10_000 - 16) // 3 + 5, 10_000 - 1):  # inside the first, second and last chunk
        changed = bytearray(raw)
        changed[off] ^= 1
        big.write_bytes(bytes(changed))
        assert fp(big)["sampled_sha256"] != ref["sampled_sha256"], off
    big.write_bytes(bytes(raw) + b"\0")
    assert fp(big)["size"] == 10_001 and fp(big)["sampled_sha256"] != ref["sampled_sha256"]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """Two byte-level token files of different text (vocabulary 256, as the tiny preset's model)."""
    root = tmp_path_factory.mktemp("corpora")
    out = {}
    for name, text in (("a", "the first corpus of text. " * 3000), ("b", "a second text, other data " * 3000)):
        (root / f"{name}.txt").write_text(text)
        assert prepare_cli(root / f"{name}.txt", "--out", root / f"{name}.bin", "--no-eot").returncode == 0
    out["a"], out["b"], out["root"] = root / "a.bin", root / "b.bin", root
    return out


JOB = ("train.steps=4", "train.stop_after=1")


@pytest.mark.parametrize("what", ["path", "val_path", "sidecar"])
def test_resume_refuses_a_changed_data_file_unless_allowed(tmp_path, corpora, what):
    """The header records the data files' fingerprints; a resume after data.path or data.val_path (or a sidecar)
    changed is refused with exit 2 naming the file and ckpt.allow_config_change=[data], and the ledger is left as
    it was; with that override it resumes and the header records the change."""
    import shutil

    tok, val = tmp_path / "tok.bin", tmp_path / "val.bin"
    for src, dst in ((corpora["a"], tok), (corpora["a"], val)):
        shutil.copy(src, dst)
        shutil.copy(src.with_name(src.name + ".json"), dst.with_name(dst.name + ".json"))
    args = (f"data.path={tok}", f"data.val_path={val}", "eval.every=2", "eval.batches=2")
    run = tmp_path / "run"
    train(run, *args, *JOB)
    header, _ = read_ledger(run)
    assert set(header["data_files"]) == {"data.path", "data.val_path"}
    assert header["data_files"]["data.path"]["size"] == tok.stat().st_size
    changed = {"path": tok, "val_path": val, "sidecar": tok.with_name("tok.bin.json")}[what]
    if what == "sidecar":
        changed.write_text(changed.read_text().replace('"glob"', '"glob" ', 1))  # same tokens, another sidecar
    else:
        shutil.copy(corpora["b"], changed)  # the same size, other text
        assert changed.stat().st_size == corpora["a"].stat().st_size
    before = (run / "ledger.jsonl").read_bytes()
    p = train(run, *args, "train.steps=4", "ckpt.resume=auto", check=False)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    key = "data.val_path" if what == "val_path" else "data.path"
    shown = val if what == "val_path" else tok
    assert f"{key}={shown}" in p.stderr and "ckpt.allow_config_change=[data]" in p.stderr, p.stderr[-2000:]
    assert (run / "ledger.jsonl").read_bytes() == before
    train(run, *args, "train.steps=4", "ckpt.resume=auto", "ckpt.allow_config_change=[data]")
    header, steps = read_ledger(run)
    assert [s["step"] for s in steps] == [0, 1, 2, 3]
    assert header["data_files"][key] != header["data_changes"][0]["from"][key]
    assert header["data_changes"][0]["at_step"] == 2


def test_train_and_val_files_must_agree_on_vocabulary_and_dtype(tmp_path, corpora):
    """data.val_path prepared differently (here: with end-of-text tokens, vocabulary 257 in uint16, against the
    training file's 256 in uint8) is refused with exit 2 naming both files."""
    val = tmp_path / "val.bin"
    assert prepare_cli(corpora["root"] / "b.txt", "--out", val).returncode == 0
    p = train(tmp_path / "run", f"data.path={corpora['a']}", f"data.val_path={val}", "model.vocab_size=512",
              "eval.every=1", "eval.batches=2", check=False)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert f"data.path={corpora['a']}" in p.stderr and f"data.val_path={val}" in p.stderr, p.stderr[-2000:]
    assert "vocabulary 256" in p.stderr and "vocabulary 257" in p.stderr


# ---- issue 23: prepare never writes over its inputs or files it did not write --------------------------------
def test_prepare_refuses_an_output_that_is_an_input(tmp_path):
    src = tmp_path / "a.txt"
    src.write_text("precious text\n")
    p = prepare_cli(src, "--out", src)
    assert p.returncode == 2 and f"would overwrite the input file {src}" in p.stderr and "Traceback" not in p.stderr
    assert src.read_text() == "precious text\n"
    p = prepare_cli(tmp_path, "--out", tmp_path / "sub" / "tokens.bin")  # inside the input directory
    assert p.returncode == 2 and f"lies inside the input directory {tmp_path}" in p.stderr, p.stderr
    assert sorted(x.name for x in tmp_path.iterdir()) == ["a.txt"]
    side = tmp_path / "b.bin.json"  # the sidecar of --out would overwrite an input too
    side.write_text("{}")
    p = prepare_cli(src, side, "--out", tmp_path / "b.bin", "--force")
    assert p.returncode == 2 and f"would overwrite the input file {side}" in p.stderr, p.stderr


def test_prepare_refuses_a_directory_and_leaves_no_tmp(tmp_path):
    src = tmp_path / "in" / "a.txt"
    src.parent.mkdir()
    src.write_text("some text\n")
    out = tmp_path / "outdir"
    out.mkdir()
    p = prepare_cli(src, "--out", out)
    assert p.returncode == 2 and f"--out {out} is a directory" in p.stderr and "Traceback" not in p.stderr
    assert sorted(x.name for x in tmp_path.iterdir()) == ["in", "outdir"] and not list(out.iterdir())


def test_prepare_overwrites_its_own_output_but_not_a_foreign_file(tmp_path):
    src = tmp_path / "a.txt"
    src.write_text("some text\n")
    out = tmp_path / "t.bin"
    assert prepare_cli(src, "--out", out).returncode == 0
    assert prepare_cli(src, "--out", out, "--no-eot").returncode == 0  # its own file: rewritten
    foreign = tmp_path / "user.bin"
    foreign.write_bytes(b"user data")
    p = prepare_cli(src, "--out", foreign)
    assert p.returncode == 2 and "was not written by prepare" in p.stderr and "--force" in p.stderr, p.stderr
    assert foreign.read_bytes() == b"user data"
    assert prepare_cli(src, "--out", foreign, "--force").returncode == 0
    assert bytes(np.asarray(load_tokens(DataConfig(path=str(foreign))))[:-1].astype(np.uint8)) == src.read_bytes()
    assert not [x.name for x in tmp_path.iterdir() if x.name.endswith(".tmp")]


def test_prepare_with_a_tokenizer_that_is_not_json(tmp_path):
    src = tmp_path / "a.txt"
    src.write_text("some text\n")
    bad = tmp_path / "tok.json"
    bad.write_text("this is not JSON")
    p = prepare_cli(src, "--out", tmp_path / "t.bin", "--tokenizer", bad)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert f"tokenizer {bad} is not a Hugging Face tokenizers JSON file" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and not (tmp_path / "t.bin").exists()


# ---- issue 25: data from anywhere (tokenizer file or directory, JSONL, Parquet, datasets), over worker processes ---
DOCS = [f"document {i}: the quick brown fox jumps over the lazy dog " * (1 + i % 4) + "héllo ✓" for i in range(600)]


@pytest.fixture(scope="module")
def tokfiles(tmp_path_factory):
    """A byte-level BPE trained here on a few lines (no download), saved as a tokenizer.json and as a
    save_pretrained directory with bos/eos/pad tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("tok")
    (root / "train.txt").write_text("\n".join(DOCS[:20]))
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train([str(root / "train.txt")], trainers.BpeTrainer(vocab_size=320, special_tokens=["<s>", "</s>", "<pad>",
              "[UNK]"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(root / "tok.json"))
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(root / "tok.json"), bos_token="<s>", eos_token="</s>",
                                 pad_token="<pad>", unk_token="[UNK]")
    hf.save_pretrained(str(root / "tokdir"))
    return {"file": root / "tok.json", "dir": root / "tokdir", "tok": tok, "root": root}


def expected_ids(tok, docs: list[str], eot: int) -> list[int]:
    """The reference: each document encoded alone by the tokenizers library, then the end-of-text id."""
    return [i for d in docs for i in [*tok.encode(d).ids, eot]]


def test_prepare_same_bytes_whatever_the_worker_count(tmp_path, tokfiles):
    """1 and 2 worker processes write byte-identical token files and sidecars (several batches of documents:
    600 JSONL lines plus text files), and the ids are the tokenizer's own encoding of each document + eos."""
    jl = tmp_path / "in" / "docs.jsonl"
    jl.parent.mkdir()
    jl.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(DOCS)))
    for i in range(3):
        (tmp_path / "in" / f"t{i}.txt").write_text(DOCS[i])
    outs = {}
    for w in (1, 2):
        outs[w] = tmp_path / f"w{w}.bin"
        p = prepare_cli(tmp_path / "in", "--out", outs[w], "--tokenizer", tokfiles["file"], "--workers", w)
        assert p.returncode == 0, p.stderr
    assert outs[1].read_bytes() == outs[2].read_bytes()
    assert (tmp_path / "w1.bin.json").read_bytes() == (tmp_path / "w2.bin.json").read_bytes()
    tok = tokfiles["tok"]
    eos = tok.token_to_id("</s>")
    ids = np.asarray(load_tokens(DataConfig(path=str(outs[1])))).tolist()
    assert ids == expected_ids(tok, DOCS + DOCS[:3], eos)  # docs.jsonl, t0.txt, t1.txt, t2.txt (sorted paths)
    meta = json.loads((tmp_path / "w1.bin.json").read_text())
    assert (meta["bos_id"], meta["eos_id"], meta["eot_id"], meta["pad_id"]) == (
        tok.token_to_id("<s>"), eos, eos, tok.token_to_id("<pad>"))
    assert meta["tokenizer"] == str(tokfiles["file"].resolve()) and meta["n_documents"] == len(DOCS) + 3
    assert meta["vocab_size"] == tok.get_vocab_size() and meta["dtype"] == "uint16"


def test_prepare_with_a_tokenizer_directory(tmp_path, tokfiles):
    """A save_pretrained directory loads through AutoTokenizer (no longer "does not exist"): the same ids as its
    tokenizer.json, and its own bos/eos/pad ids in the sidecar with the directory as the tokenizer."""
    from transformers import AutoTokenizer

    src = tmp_path / "a.txt"
    src.write_text(DOCS[5])
    p = prepare_cli(src, "--out", tmp_path / "d.bin", "--tokenizer", tokfiles["dir"], "--workers", 2)
    assert p.returncode == 0, p.stderr
    hf = AutoTokenizer.from_pretrained(str(tokfiles["dir"]))
    meta = json.loads((tmp_path / "d.bin.json").read_text())
    assert (meta["bos_id"], meta["eos_id"], meta["pad_id"]) == (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id)
    assert meta["tokenizer"] == str(tokfiles["dir"].resolve()) and meta["tokenizer_kind"] == "transformers"
    ids = np.asarray(load_tokens(DataConfig(path=str(tmp_path / "d.bin")))).tolist()
    assert ids == [*hf(DOCS[5])["input_ids"], hf.eos_token_id]


def test_prepare_jsonl_parquet_and_datasets_give_the_documents_tokens(tmp_path, tokfiles):
    """--field picks the text of JSONL lines, Parquet rows and a saved dataset's rows: each input gives the same
    tokens as the documents written as text files."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    docs = DOCS[:40]
    for i, d in enumerate(docs):
        (tmp_path / "txt" / f"{i:03d}.txt").parent.mkdir(exist_ok=True)
        (tmp_path / "txt" / f"{i:03d}.txt").write_text(d)
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in docs))
    pq.write_table(pa.table({"body": docs, "n": list(range(len(docs)))}), tmp_path / "d.parquet")
    inputs = {"txt": [tmp_path / "txt"], "jsonl": [tmp_path / "d.jsonl"], "parquet": [tmp_path / "d.parquet"]}
    try:
        import datasets

        datasets.Dataset.from_dict({"body": docs}).save_to_disk(str(tmp_path / "ds"))
        datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": docs}),
                              "test": datasets.Dataset.from_dict({"body": ["held out"]})}).save_to_disk(
            str(tmp_path / "dd"))
        inputs |= {"dataset": [tmp_path / "ds"], "dict": [tmp_path / "dd"]}
    except ImportError:
        pass  # the datasets library is optional: the other inputs still run
    got = {}
    for name, ins in inputs.items():
        p = prepare_cli(*ins, "--out", tmp_path / f"{name}.bin", "--tokenizer", tokfiles["file"], "--field", "body")
        assert p.returncode == 0, (name, p.stderr)
        got[name] = np.asarray(load_tokens(DataConfig(path=str(tmp_path / f"{name}.bin")))).tolist()
    tok = tokfiles["tok"]
    want = expected_ids(tok, docs, tok.token_to_id("</s>"))
    assert all(v == want for v in got.values()), [k for k, v in got.items() if v != want]
    # byte level: a JSONL document is its UTF-8 bytes, then 256
    assert prepare_cli(tmp_path / "d.jsonl", "--out", tmp_path / "b.bin", "--field", "body").returncode == 0
    assert np.asarray(load_tokens(DataConfig(path=str(tmp_path / "b.bin")))).tolist() == \
        [b for d in docs for b in [*d.encode(), 256]]


def test_prepare_bad_fields_are_exit_2_naming_the_place(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"text": "fine"}\n{"body": "no text"}\n')
    p = prepare_cli(tmp_path / "d.jsonl", "--out", tmp_path / "o.bin")
    assert p.returncode == 2 and f"{tmp_path / 'd.jsonl'}:2 has no field 'text'" in p.stderr and "--field" in p.stderr
    (tmp_path / "n.jsonl").write_text('{"text": 3}\n')
    p = prepare_cli(tmp_path / "n.jsonl", "--out", tmp_path / "o.bin")
    assert p.returncode == 2 and "not a string" in p.stderr and "Traceback" not in p.stderr
    (tmp_path / "e.jsonl").write_text("\n")
    p = prepare_cli(tmp_path / "e.jsonl", "--out", tmp_path / "o.bin")
    assert p.returncode == 2 and "no documents" in p.stderr
    assert not (tmp_path / "o.bin").exists() and not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".*"))
    p = prepare_cli(tmp_path / "d.jsonl", "--out", tmp_path / "o.bin", "--tokenizer", tmp_path / "nothere")
    assert p.returncode == 2 and "does not exist" in p.stderr and "directory" in p.stderr


# ---- issue 43: tokenizers without a vocabulary, undecodable JSONL, and the validation file's tokenizer ------------
def test_prepare_hostile_inputs_are_one_line_and_leave_nothing(tmp_path):
    (tmp_path / "bin.jsonl").write_bytes(b'{"text": "fine"}\n{"text": "\xff\xfe binary"}\n')
    (tmp_path / "ok.jsonl").write_text('{"text": "hello world"}\n')
    empty = tmp_path / "tokconf"  # a tokenizer_config.json alone: transformers builds a tokenizer of no vocabulary
    empty.mkdir()
    (empty / "tokenizer_config.json").write_text('{"tokenizer_class": "GPT2Tokenizer"}')
    cases = [((tmp_path / "bin.jsonl", "--out", tmp_path / "o.bin"), f"{tmp_path / 'bin.jsonl'}:2 is not UTF-8"),
             ((tmp_path / "ok.jsonl", "--out", ""), "--out is empty"),
             ((tmp_path / "ok.jsonl", "--out", tmp_path / "o.bin", "--tokenizer", empty), "to no tokens")]
    for args, msg in cases:
        p = prepare_cli(*args)
        assert p.returncode == 2 and msg in p.stderr and "Traceback" not in p.stderr, (args, p.stderr)
        assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert sorted(x.name for x in tmp_path.iterdir()) == ["bin.jsonl", "ok.jsonl", "tokconf"]


def test_validation_file_of_another_tokenizer_is_refused(tmp_path, tokfiles):
    """Two tokenizers of the same vocabulary size (so the same dtype), or one tokenizer with another end-of-text
    token: check_same_format compares the sidecars' tokenizer sha256 and end-of-text id, naming both files."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from dettrain.config import DataConfig
    from dettrain.data import check_same_format
    from dettrain.errors import UserError

    other = Tokenizer(models.BPE(unk_token="[UNK]"))
    other.pre_tokenizer = pre_tokenizers.ByteLevel()
    other.train_from_iterator(DOCS[:20], trainers.BpeTrainer(  # the same merges, the special tokens' ids swapped
        vocab_size=320, special_tokens=["</s>", "<s>", "<pad>", "[UNK]"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    other.save(str(tmp_path / "other.json"))
    (tmp_path / "docs.txt").write_text("\n".join(DOCS[:50]))
    made = {}
    for name, tok, eot in (("train", tokfiles["file"], "</s>"), ("val_other", tmp_path / "other.json", "</s>"),
                           ("val_eot", tokfiles["file"], "<pad>"), ("val_same", tokfiles["file"], "</s>")):
        made[name] = tmp_path / f"{name}.bin"
        p = prepare_cli(tmp_path / "docs.txt", "--out", made[name], "--tokenizer", tok, "--eot-token", eot)
        assert p.returncode == 0, p.stderr
    sides = {k: json.loads(v.with_name(v.name + ".json").read_text()) for k, v in made.items()}
    assert sides["train"]["vocab_size"] == sides["val_other"]["vocab_size"] and \
        sides["train"]["dtype"] == sides["val_other"]["dtype"]
    check_same_format(DataConfig(path=str(made["train"]), val_path=str(made["val_same"])))
    for name, what in (("val_other", "tokenizer (sha256)"), ("val_eot", "end-of-text id")):
        with pytest.raises(UserError, match=rf"data.path={made['train']} and data.val_path={made[name]} were "
                                            rf"prepared with another {re.escape(what)}"):
            check_same_format(DataConfig(path=str(made["train"]), val_path=str(made[name])))


def test_prepare_refuses_an_input_named_through_another_path(tmp_path):
    """--out naming an input through a symlink or a '..' path is the input: refused, the input unchanged."""
    src = tmp_path / "in" / "a.txt"
    src.parent.mkdir()
    src.write_text("precious text\n")
    (tmp_path / "link.bin").symlink_to(src)
    (tmp_path / "other").mkdir()
    for out in (tmp_path / "link.bin", tmp_path / "other" / ".." / "in" / "a.txt"):
        p = prepare_cli(src, "--out", out, "--force")
        assert p.returncode == 2 and f"would overwrite the input file {src}" in p.stderr, (out, p.stderr)
    assert src.read_text() == "precious text\n" and not list(tmp_path.rglob("*.json"))


# ---- Hub ids through the Hugging Face cache: datasets (--streaming) and tokenizers ------------------------------
def test_prepare_a_hub_dataset_and_a_hub_tokenizer_from_the_cache(tmp_path, tokfiles):
    """``prepare org/texts --tokenizer org/tok`` offline (HF_HOME laid out as huggingface_hub lays it out, built
    here): the dataset's train split through load_dataset, with and without --streaming, gives the same bytes as
    its JSONL file prepared directly with the tokenizer's directory; the sidecar names the tokenizer's snapshot."""
    pytest.importorskip("datasets")
    from conftest import hub_repo

    src = tmp_path / "ds_src" / "data"
    src.mkdir(parents=True)
    (src / "train.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS[:300]))
    (src / "test.jsonl").write_text(json.dumps({"text": "held out"}) + "\n")
    home = tmp_path / "hf_home"
    hub_repo(home, "org/texts", src.parent, repo_type="dataset")
    tok_snap = hub_repo(home, "org/tok", tokfiles["dir"])
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    outs = {}
    for name, extra in (("hub", []), ("stream", ["--streaming"])):
        outs[name] = tmp_path / f"{name}.bin"
        p = subprocess.run([sys.executable, "-m", "dettrain.data", "prepare", "org/texts", "--out", str(outs[name]),
                            "--tokenizer", "org/tok", "--workers", "1", *extra], capture_output=True, text=True,
                           cwd=REPO, env=env)
        assert p.returncode == 0, p.stderr
    direct = tmp_path / "direct.bin"
    p = prepare_cli(src / "train.jsonl", "--out", direct, "--tokenizer", tokfiles["dir"], "--workers", "1")
    assert p.returncode == 0, p.stderr
    assert outs["hub"].read_bytes() == outs["stream"].read_bytes() == direct.read_bytes()
    meta = json.loads((tmp_path / "hub.bin.json").read_text())
    assert meta["tokenizer"] == str(tok_snap.resolve()) and meta["n_documents"] == 300
    # a Hub id the cache does not hold: one line naming the input and the fix, exit 2 (offline: nothing fetched)
    p = subprocess.run([sys.executable, "-m", "dettrain.data", "prepare", "org/missing", "--out",
                        str(tmp_path / "m.bin")], capture_output=True, text=True, cwd=REPO, env=env)
    assert p.returncode == 2 and "input='org/missing'" in p.stderr and "HF_HOME" in p.stderr
    assert "Traceback" not in p.stderr
