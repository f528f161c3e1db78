"""python -m dettrain.export: a checkpoint of dettrain's LLaMA -> a Hugging Face directory with the same logits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, tmpfs, train

from dettrain.models.llama import build_model
from dettrain.record.fingerprint import combine, fingerprint, format_fp
from dettrain.record.ledger import read_ledger
from dettrain.tools.export import load_llama

transformers = pytest.importorskip("transformers")


def export_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dettrain.export", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("tier,extra", [(3, []), (2, ["model.tie_embeddings=true"])],
                         ids=["flat-layout-tier3", "per-name-layout-tier2-tied"])
def test_export_gives_hf_the_same_logits(tmp_path, tier, extra):
    run = tmp_path / "run"
    train(run, f"det.tier={tier}", "train.stop_after=1", *extra)  # 2 steps, then a checkpoint of step 2
    out = tmp_path / "hf"
    p = export_cli(run, "--out", out)
    assert p.returncode == 0, p.stderr
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()

    ckpt = run / "checkpoints" / "step_00000002"
    cfg, params, _ = load_llama(ckpt)
    # the exported weights are the trained ones: they hash to the ledger's parameters after step index 1
    _, steps = read_ledger(run)
    names = [n for n, _ in build_model(cfg, 0, "meta").named_parameters()][::-1]  # canonical order
    offsets, off = {}, 0
    for n in names:
        offsets[n] = off
        off += params[n].numel()
    assert format_fp(combine(fingerprint(params[n].reshape(-1), offsets[n]) for n in names)) == steps[1]["param"]

    ours = build_model(cfg, seed=123)  # other init, then the checkpoint's weights
    ours.load_state_dict(params, strict=True)
    hf = transformers.LlamaForCausalLM.from_pretrained(out, attn_implementation="eager")
    assert next(hf.parameters()).dtype == torch.float32
    ours.eval()
    hf.eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = ours(tokens)
        b = hf(tokens, use_cache=False).logits
    assert a.shape == b.shape == (2, cfg.seq_len, cfg.vocab_size)
    diff = (a - b).abs().max().item()
    assert diff < 1e-5, diff
    assert a.abs().max().item() > 0.1  # not trivially small logits


def test_bad_input_exits_2_with_a_message(tmp_path):
    p = export_cli(tmp_path / "nope", "--out", tmp_path / "o")
    assert p.returncode == 2 and "does not exist" in p.stderr and "Traceback" not in p.stderr
    empty = tmp_path / "run_without_checkpoint"
    empty.mkdir()
    p = export_cli(empty, "--out", tmp_path / "o")
    assert p.returncode == 2 and "no checkpoint" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "o").exists()


def test_custom_model_checkpoint_is_refused(tmp_path):
    tests = Path(__file__).resolve().parent
    run = tmp_path / "run"
    train(run, "model=custom", "model._target_=custom_models.MLPLM", "model.seq_len=32", "train.steps=2",
          "train.stop_after=0", "train.global_batch=4", "train.micro_batch=2", "data.max_bytes=100000",
          "log.wandb.mode=disabled", tiny=False, env={"PYTHONPATH": f"{tests}{os.pathsep}{REPO}"})
    p = export_cli(run, "--out", tmp_path / "o")
    assert p.returncode == 2 and "custom model" in p.stderr and "Traceback" not in p.stderr


# ---- issue 23: export never writes over files it did not create -------------------------------------------------
@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("exp") / "run"
    train(run, "det.tier=3", "train.stop_after=1")
    return run


def test_export_refuses_a_non_empty_out_or_a_file_unless_forced(tmp_path, stopped_run):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("my notes")
    (out / "config.json").write_text("{\"mine\": true}")
    p = export_cli(stopped_run, "--out", out)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert f"--out {out} is not empty" in p.stderr and "--force" in p.stderr
    assert (out / "config.json").read_text() == "{\"mine\": true}" and sorted(x.name for x in out.iterdir()) == [
        "config.json", "notes.txt"]
    f = tmp_path / "file.bin"
    f.write_bytes(b"user data")
    p = export_cli(stopped_run, "--out", f)
    assert p.returncode == 2 and f"--out {f} is an existing file" in p.stderr and f.read_bytes() == b"user data"
    p = export_cli(stopped_run, "--out", out, "--force")
    assert p.returncode == 0, p.stderr
    assert (out / "model.safetensors").is_file() and (out / "notes.txt").read_text() == "my notes"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert export_cli(stopped_run, "--out", empty).returncode == 0  # an empty directory is fine


def test_export_onto_read_only_or_immutable_targets_is_one_line(tmp_path, stopped_run):
    with tmpfs(tmp_path / "ro", "ro,size=1m") as ro:
        p = export_cli(stopped_run, "--out", ro / "hf")
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
        assert str(ro / "hf") in p.stderr and "Read-only file system" in p.stderr, p.stderr
    imm = tmp_path / "imm"
    imm.mkdir()
    if subprocess.run(["chattr", "+i", str(imm)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available on this file system")
    try:
        p = export_cli(stopped_run, "--out", imm)
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
        assert str(imm) in p.stderr and "Operation not permitted" in p.stderr and "chattr -i" in p.stderr, p.stderr
    finally:
        subprocess.run(["chattr", "-i", str(imm)])


# ---- issue 25: models that leave dettrain (HF models, the data's token ids, the tokenizer) ----------------------
TINY_HF = ["model=hf_llama", "model.seq_len=32", "model.hidden_size=32", "model.intermediate_size=64",
           "model.num_hidden_layers=2", "model.num_attention_heads=4", "model.num_key_value_heads=2",
           "train.global_batch=8", "train.micro_batch=2", "log.wandb.mode=disabled"]


def prepare(tmp_path: Path, *args: str) -> Path:
    """A token file of a few of dettrain's own sources, written by the real prepare command."""
    docs = tmp_path / "docs"
    docs.mkdir()
    for f in sorted((REPO / "dettrain").glob("*.py"))[:12]:
        (docs / f.name).write_text(f.read_text())
    tokens = tmp_path / "tokens.bin"
    p = subprocess.run([sys.executable, "-m", "dettrain.data", "prepare", str(docs), "--out", str(tokens), *args],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return tokens


def logits_and_generate(out: Path, ours: torch.nn.Module, vocab: int, seq: int) -> None:
    """from_pretrained(out) gives dettrain's logits (fp32, CPU) and greedy-generates from them."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    assert next(hf.parameters()).dtype == torch.float32
    hf.eval()
    ours.eval()
    tokens = torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = ours(tokens)
        b = hf(tokens, use_cache=False).logits
        assert a.shape == b.shape == (2, seq, vocab)
        assert (a - b).abs().max().item() < 1e-5
        assert a.abs().max().item() > 0.1
        gen = hf.generate(tokens[:, :8], max_new_tokens=4, do_sample=False)  # may stop early at eos
        assert 8 < gen.shape[1] <= 12 and torch.equal(gen[:, :8], tokens[:, :8])
        # greedy: the first new token is the argmax of dettrain's own logits after the prompt
        assert torch.equal(gen[:, 8], ours(tokens[:, :8])[:, -1].argmax(-1))


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral"])
def test_export_hf_model_save_pretrained_with_the_token_ids(tmp_path, model_type):
    from dettrain.config import model_config
    from dettrain.tools.export import load_params

    tokens = prepare(tmp_path)  # byte level: vocabulary 257, end-of-text 256
    run = tmp_path / "run"
    train(run, *TINY_HF, f"model.model_type={model_type}", "train.steps=2", f"data.path={tokens}",
          "model.vocab_size=257", tiny=False)
    out = tmp_path / "hf"
    p = export_cli(run, "--out", out)  # the final checkpoint (ckpt.final), as save_pretrained writes it
    assert p.returncode == 0, p.stderr
    conf = json.loads((out / "config.json").read_text())
    gen = json.loads((out / "generation_config.json").read_text())
    assert conf["model_type"] == model_type and conf["vocab_size"] == 257 and conf["use_cache"] is True
    assert (conf["bos_token_id"], conf["eos_token_id"], conf["pad_token_id"]) == (256, 256, 256)
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (256, 256, 256)
    st = __import__("safetensors.torch", fromlist=["load_file"]).load_file(str(out / "model.safetensors"))
    assert not any(k.startswith("hf.") for k in st)

    header, _ = read_ledger(run)
    params, _ = load_params(run / "checkpoints" / "step_00000002")
    ours = build_model(model_config(header["config"]["model"]), 0)
    assert sorted(params) == sorted(n for n, _ in ours.named_parameters())
    with torch.no_grad():
        for n, q in ours.named_parameters():
            q.copy_(params[n])
    logits_and_generate(out, ours, 257, 32)


def test_export_llama_copies_the_tokenizer_and_its_end_of_text_id(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    src = sorted((REPO / "dettrain").glob("*.py"))[:12]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train([str(f) for f in src], trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|endoftext|>"]))
    tok_file = tmp_path / "tok.json"
    tok.save(str(tok_file))
    eot = tok.token_to_id("<|endoftext|>")
    tokens = prepare(tmp_path, "--tokenizer", str(tok_file))
    run = tmp_path / "run"
    train(run, "train.steps=2", f"data.path={tokens}", "model.vocab_size=0", "model.seq_len=32")
    out = tmp_path / "hf"
    p = export_cli(run, "--out", out)
    assert p.returncode == 0, p.stderr
    conf = json.loads((out / "config.json").read_text())
    gen = json.loads((out / "generation_config.json").read_text())
    assert conf["eos_token_id"] == gen["eos_token_id"] == eot and conf["bos_token_id"] == eot
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tok.eos_token == "<|endoftext|>" and hf_tok.eos_token_id == eot
    text = "def f(x):\n    return x\n"
    assert hf_tok(text)["input_ids"] == tok.encode(text).ids

    cfg, params, _ = load_llama(run / "checkpoints" / "step_00000002")
    ours = build_model(cfg, seed=123)
    ours.load_state_dict(params, strict=True)
    logits_and_generate(out, ours, cfg.vocab_size, 32)


# ---- issue 43: AutoTokenizer.from_pretrained(export) encodes as prepare did, for every family ---------------------
QWEN_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
              r"""\s*[\r\n]+|\s+(?!\S)|\s+""")


def bpe_tokenizer(path: Path, style: str) -> Path:
    """A tiny BPE trained on dettrain's sources: GPT-2's byte-level pipeline ("gpt2") or Qwen2's (NFC, its split
    regex, byte level without a prefix space: "qwen"), with end-of-text, bos and pad tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    if style == "qwen":
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.decoder = decoders.ByteLevel()
    tok.train([str(f) for f in sorted((REPO / "dettrain").glob("*.py"))[:12]],
              trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>", "<s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path))
    return path


@pytest.mark.parametrize("family,style", [("dettrain", "gpt2"), ("llama", "gpt2"), ("mistral", "gpt2"),
                                          ("qwen2", "qwen"), ("qwen2", "gpt2")])
def test_exported_tokenizer_encodes_as_prepare_for_every_family(tmp_path, family, style):
    """Every id prepare wrote is what AutoTokenizer gives on the exported directory (the documents re-encoded, each
    followed by end-of-text).  Where transformers would load another class than the training tokenizer's for the
    model_type (qwen2 with a GPT-2-style tokenizer: Qwen2Tokenizer rebuilds its own pre-tokenizer), the tokenizer
    goes to out/tokenizer/ with a warning, and the root holds none that would give other ids.  bos/pad come from
    the sidecar; a tokenizer replaced since prepare is refused (exit 2) and --no-tokenizer exports without it."""
    import numpy as np

    tok_file = bpe_tokenizer(tmp_path / "tok.json", style)
    tokens = prepare(tmp_path, "--tokenizer", str(tok_file))
    side = json.loads((tmp_path / "tokens.bin.json").read_text())
    from tokenizers import Tokenizer

    t = Tokenizer.from_file(str(tok_file))
    assert side["bos_id"] == t.token_to_id("<s>") != side["eot_id"] == t.token_to_id("<|endoftext|>")
    run = tmp_path / "run"
    if family == "dettrain":
        train(run, "train.steps=1", f"data.path={tokens}", "model.vocab_size=0", "model.seq_len=32")
    else:
        train(run, *TINY_HF, f"model.model_type={family}", "train.steps=1", f"data.path={tokens}",
              f"model.vocab_size={side['vocab_size']}", tiny=False)
    out = tmp_path / "hf"
    p = export_cli(run, "--out", out)
    assert p.returncode == 0, p.stderr
    conf = json.loads((out / "config.json").read_text())
    assert conf["model_type"] == ("llama" if family == "dettrain" else family)
    assert (conf["bos_token_id"], conf["eos_token_id"]) == (side["bos_id"], side["eot_id"])
    moved = family == "qwen2" and style == "gpt2"
    tok_dir = out / "tokenizer" if moved else out
    assert ("warning: for model_type qwen2" in p.stdout) == moved and (out / "tokenizer").is_dir() == moved
    assert not (moved and ((out / "tokenizer.json").exists() or (out / "tokenizer_config.json").exists()))
    assert json.loads((out / "dettrain_export.json").read_text())["tokenizer_dir"] == ("tokenizer" if moved else ".")
    assert json.loads((tok_dir / "tokenizer_config.json").read_text())["pad_token"] == "<pad>"
    auto = transformers.AutoTokenizer.from_pretrained(tok_dir)
    docs = [f.read_text() for f in sorted((tmp_path / "docs").iterdir())]
    want = np.concatenate([np.asarray([*ids, side["eot_id"]]) for ids in auto(docs)["input_ids"]])
    assert np.array_equal(np.fromfile(tokens, dtype=side["dtype"]).astype(np.int64), want)
    if family != "dettrain":
        return
    # the tokenizer replaced since prepare: refused, nothing written; --no-tokenizer exports the model alone
    bpe_tokenizer(tok_file, "qwen")
    p = export_cli(run, "--out", tmp_path / "hf2")
    assert p.returncode == 2 and "changed since prepare" in p.stderr and "--no-tokenizer" in p.stderr, p.stderr
    assert not (tmp_path / "hf2").exists()
    p = export_cli(run, "--out", tmp_path / "hf3", "--no-tokenizer")
    assert p.returncode == 0 and not (tmp_path / "hf3" / "tokenizer.json").exists(), p.stderr


# ---- issue 43: a full disk leaves nothing behind; an older checkpoint is never taken in silence -------------------
def test_full_disk_during_export_and_to_torch_is_one_line_and_leaves_nothing(tmp_path, stopped_run):
    """--out on a full tmpfs: exit 2 naming the file and 'No space left on device', no traceback; export removes
    what it wrote (an empty config.json would block the rerun), to-torch leaves no .tmp; the rerun on room works."""
    with tmpfs(tmp_path / "mnt", leave=64 * 1024) as mnt:  # room for config.json, not for the weights
        p = export_cli(stopped_run, "--out", mnt / "hf")
        assert p.returncode == 2 and "Traceback" not in p.stderr and "No space left on device" in p.stderr, p.stderr
        assert str(mnt / "hf") in p.stderr and sorted(x.name for x in mnt.iterdir()) == ["filler"]
        p = subprocess.run([sys.executable, "-m", "dettrain.checkpoint", "to-torch", str(stopped_run), "--out",
                            str(mnt / "model.pt")], cwd=REPO, capture_output=True, text=True, timeout=300)
        assert p.returncode == 2 and "Traceback" not in p.stderr and "No space left on device" in p.stderr, p.stderr
        assert str(mnt / "model.pt") in p.stderr and sorted(x.name for x in mnt.iterdir()) == ["filler"]
        (mnt / "filler").unlink()
        assert export_cli(stopped_run, "--out", mnt / "hf").returncode == 0


def test_export_and_to_torch_name_the_damaged_checkpoint_they_skip(tmp_path):
    run = tmp_path / "run"
    train(run, "det.tier=3", "train.stop_after=1", "ckpt.every=1")  # step_00000001 and step_00000002
    newest = run / "checkpoints" / "step_00000002"
    (newest / "__0_0.distcp").write_bytes(b"damaged")
    p = export_cli(run, "--out", tmp_path / "hf")
    assert p.returncode == 0 and "step_00000001" in p.stdout, p.stderr
    assert f"warning: skipped a newer checkpoint: checkpoint {newest}" in p.stderr, p.stderr
    p = subprocess.run([sys.executable, "-m", "dettrain.checkpoint", "to-torch", str(run), "--out",
                        str(tmp_path / "m.pt")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and f"skipped a newer checkpoint: checkpoint {newest}" in p.stderr, p.stderr


def test_export_of_a_pretrained_start_writes_the_trained_weights_and_the_models_tokenizer(tmp_path, monkeypatch):
    """A Hub model (tokenizer + tiny Llama, in an HF cache built here, offline): ``prepare --tokenizer org/name``,
    ``model=hf_llama model.pretrained=org/name``, ``export``: the export holds the checkpoint's trained weights (not
    the file it started from), the model's tokenizer (and none of the source's weight files), and loads as is."""
    from conftest import hub_repo
    from safetensors.torch import load_file
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from dettrain.tools.export import load_params

    src = tmp_path / "src"
    files = sorted((REPO / "dettrain").glob("*.py"))[:12]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train([str(f) for f in files], trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"]))
    tok.save(str(tmp_path / "tok.json"))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tok.json"), eos_token="</s>",
                                                unk_token="<unk>")
    fast.save_pretrained(str(src))
    torch.manual_seed(3)
    cfg = transformers.LlamaConfig(vocab_size=len(fast), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(src))
    snap = hub_repo(tmp_path / "home", "org/tiny", src)
    for k, v in {"HF_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1"}.items():
        monkeypatch.setenv(k, v)  # prepare, train, export and load_params (config.json) resolve org/tiny offline
    tokens = prepare(tmp_path, "--tokenizer", "org/tiny")
    run = tmp_path / "run"
    train(run, "model=hf_llama", "model.pretrained=org/tiny", "model.seq_len=32", "train.steps=2",
          "train.global_batch=8", "train.micro_batch=2", f"data.path={tokens}", "log.wandb.mode=disabled", tiny=False)
    out = tmp_path / "hf"
    p = export_cli(run, "--out", out)
    assert p.returncode == 0, p.stderr
    params, _ = load_params(run / "checkpoints" / "step_00000002")
    exported = load_file(str(out / "model.safetensors"))
    started = load_file(str(snap / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(exported[name], params["hf." + name]) and not torch.equal(exported[name], started[name])
    assert sorted(f.name for f in out.glob("*.safetensors")) == ["model.safetensors"]
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "def f(x):\n    return x\n"
    assert hf_tok(text)["input_ids"] == tok.encode(text).ids and hf_tok.eos_token == "</s>"
    assert json.loads((out / "config.json").read_text())["vocab_size"] == len(fast)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(hf.model.layers[0].self_attn.q_proj.weight, params["hf." + name])


def test_to_torch_of_an_hf_model_loads_as_it_is_with_its_optimizer_state(tmp_path):
    """to-torch of model=hf_llama: the file's keys are the transformers model's own (no hf. prefix), so its
    load_state_dict(strict=True) takes it; --optim holds AdamW's state in get_optimizer_state_dict's layout, which
    set_optimizer_state_dict loads into a plain AdamW of that model.  Every file follows the umask."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    run, out = tmp_path / "run", tmp_path / "hf"
    train(run, *TINY_HF, "train.steps=2", "model.vocab_size=257", tiny=False)
    old = os.umask(0o002)
    try:
        p = subprocess.run([sys.executable, "-m", "dettrain.checkpoint", "to-torch", str(run), "--out",
                            str(tmp_path / "m.pt"), "--optim", str(tmp_path / "o.pt")], cwd=REPO, capture_output=True,
                           text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        assert "to-torch: 1/4 stage (25%)" in p.stderr and "to-torch: done, 4 stage in " in p.stderr  # a log's lines
        e = export_cli(run, "--out", out)
        assert e.returncode == 0 and "export: done, 3 stage in " in e.stderr, e.stderr
    finally:
        os.umask(old)
    for f in (tmp_path / "m.pt", tmp_path / "o.pt", out / "model.safetensors", out / "config.json"):
        assert f.stat().st_mode & 0o777 == 0o664, (f, oct(f.stat().st_mode))
    sd = torch.load(tmp_path / "m.pt", weights_only=True)
    assert not any(k.startswith("hf.") for k in sd)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(out))
    model.load_state_dict(sd, strict=True)
    exported = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), exported.state_dict().values()))

    ck = run / "checkpoints" / "step_00000002"
    key = "optim/hf.model.embed_tokens.weight/exp_avg"
    want = {key: torch.empty(sd["model.embed_tokens.weight"].shape)}
    dcp.load(want, checkpoint_id=ck)
    osd = torch.load(tmp_path / "o.pt", weights_only=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1.0)
    set_optimizer_state_dict(model, opt, optim_state_dict=osd)
    state = opt.state[model.model.embed_tokens.weight]
    assert torch.equal(state["exp_avg"], want[key]) and state["step"].item() == 2.0
    again = get_optimizer_state_dict(model, opt)
    assert sorted(again["state"]) == sorted(osd["state"]) == sorted(n for n, _ in model.named_parameters())
    assert [g["params"] for g in again["param_groups"]] == [g["params"] for g in osd["param_groups"]]
    assert opt.param_groups[0]["betas"] == osd["param_groups"][0]["betas"]
