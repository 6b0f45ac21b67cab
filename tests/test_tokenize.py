"""prime-tokenize and the tokenized data it feeds to training.

The reference for every token is the tokenizers library called directly on each
document (`Tokenizer.encode(doc).ids + [eos]`, in input order), never the
pipeline's own batching, pieces, shards or workers.
"""

import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest

tokenizers = pytest.importorskip("tokenizers", reason="prime-tokenize needs the tokenizers library (make deps)")

from prime import tokenize as tk  # noqa: E402
from prime.config import load_config  # noqa: E402
from prime.data import META_FILE, load_source, read_metadata  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ["the", "ring", "node", "café", "naïve", "中文", "données", "🙂", "x=1;", "(a, b)", "42", "3.14", "don't",
         "HTTP", "\t", "  ", "--", "...", "Ünïcödé"]


def _text(rng: random.Random, n_lines: int) -> str:
    lines = []
    for _ in range(n_lines):
        k = rng.randrange(0, 12)
        line = " ".join(rng.choice(WORDS) for _ in range(k))
        lines.append(line + rng.choice(["", "", " ", ".", "  "]))
    return "\n".join(lines) + rng.choice(["", "\n", "\n\n"])


def make_corpus(root: str, seed: int, *, text_files=6, jsonl_docs=40, parquet_docs=0) -> list:
    """Text files in two directories, a JSONL file (with other fields and an empty line) and optionally a
    Parquet file; returns the documents in the order prime-tokenize reads them (a sorted walk, top-down: the
    top level's files, then a/, then a/deeper/)."""
    rng = random.Random(seed)
    docs = []
    os.makedirs(os.path.join(root, "a", "deeper"), exist_ok=True)
    os.makedirs(os.path.join(root, ".hidden"), exist_ok=True)
    with open(os.path.join(root, ".hidden", "skip.txt"), "w") as f:
        f.write("never read")
    with open(os.path.join(root, "a", "image.bin"), "wb") as f:
        f.write(b"\x89PNG\0\0binary")
    plan = [os.path.join(root, "a", "deeper", f"t{i}.txt") for i in range(text_files // 2)]
    plan += [os.path.join(root, "a", f"t{i}.md") for i in range(text_files - text_files // 2)]
    files = {}
    for p in plan:
        files[p] = _text(rng, rng.randrange(1, 60))
    for p, t in files.items():
        with open(p, "w", encoding="utf-8") as f:
            f.write(t)
    order = sorted(p for p in files if os.path.dirname(p) == os.path.join(root, "a"))
    order += sorted(p for p in files if os.path.dirname(p) == os.path.join(root, "a", "deeper"))
    jdocs = [_text(rng, rng.randrange(1, 8)) for _ in range(jsonl_docs)]
    with open(os.path.join(root, "b.jsonl"), "w", encoding="utf-8") as f:
        for i, d in enumerate(jdocs):
            f.write(json.dumps({"id": i, "text": d, "meta": {"n": i}}) + "\n")
            if i == 3:
                f.write("\n")
    docs += jdocs
    if parquet_docs:
        pa = pytest.importorskip("pyarrow")
        import pyarrow.parquet as pq

        pdocs = [_text(rng, rng.randrange(1, 6)) for _ in range(parquet_docs)]
        pq.write_table(pa.table({"text": pdocs, "n": list(range(parquet_docs))}),
                       os.path.join(root, "c.parquet"), row_group_size=7)
        docs += pdocs
    return docs + [files[p] for p in order]


def reference_tokens(tokenizer_json: str, docs: list, eos: str) -> np.ndarray:
    tok = tokenizers.Tokenizer.from_file(tokenizer_json)
    eos_id = tok.token_to_id(eos)
    out = []
    for d in docs:
        out += tok.encode(d, add_special_tokens=False).ids + [eos_id]
    return np.array(out, dtype=np.int64)


def all_tokens(out_dir: str) -> np.ndarray:
    src = load_source("bin", out_dir)
    return np.concatenate([np.asarray(a, dtype=np.int64) for a in src.arrays])


def quiet(_msg):
    pass


def test_trained_bpe_tokens_equal_the_library_on_every_document(tmp_path, seed):
    docs = make_corpus(str(tmp_path / "corpus"), seed, parquet_docs=30)
    out = str(tmp_path / "tok")
    meta = tk.tokenize(tk.Settings(inputs=[str(tmp_path / "corpus")], out=out, vocab_size=400, shard_size_mb=0.002,
                                   progress=False), say=quiet)
    assert meta == read_metadata(out)
    trained = tokenizers.Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    assert meta["vocab_size"] == trained.get_vocab_size() <= 400 and meta["tokenizer"]["requested_vocab_size"] == 400
    assert meta["dtype"] == "uint16" and meta["tokenizer"]["eos_id"] == 0
    assert meta["num_documents"] == len(docs) and meta["inputs"]["skipped_binary"] == 1
    assert len(meta["shards"]) > 3, "the plan should have cut the inputs into several shards"
    ref = reference_tokens(os.path.join(out, "tokenizer.json"), docs, tk.TRAINED_EOS)
    got = all_tokens(out)
    assert meta["num_tokens"] == len(ref) == len(got), f"seed {seed}"
    assert np.array_equal(got, ref), f"seed {seed}"
    assert meta["tokenizer"]["sha256"] == tk._sha256(os.path.join(out, "tokenizer.json"))
    assert not [n for n in os.listdir(out) if n.endswith(".tmp")]


def test_workers_and_pieces_do_not_change_a_token(tmp_path, seed, monkeypatch):
    """Two worker processes and text documents cut into pieces give the bytes of one process and whole texts."""
    docs = make_corpus(str(tmp_path / "corpus"), seed, text_files=4, jsonl_docs=30)
    one = str(tmp_path / "one")
    tk.tokenize(tk.Settings(inputs=[str(tmp_path / "corpus")], out=one, vocab_size=300, shard_size_mb=0.001,
                            progress=False), say=quiet)
    two = str(tmp_path / "two")
    tk.tokenize(tk.Settings(inputs=[str(tmp_path / "corpus")], out=two, tokenizer=os.path.join(one, "tokenizer.json"),
                            shard_size_mb=0.001, workers=2, progress=False), say=quiet)
    assert np.array_equal(all_tokens(one), all_tokens(two))
    monkeypatch.setattr(tk, "TEXT_PIECE_CHARS", 64)  # every text document in many pieces
    cut = str(tmp_path / "cut")
    tk.tokenize(tk.Settings(inputs=[str(tmp_path / "corpus")], out=cut, tokenizer=os.path.join(one, "tokenizer.json"),
                            shard_size_mb=0.001, progress=False), say=quiet)
    ref = reference_tokens(os.path.join(one, "tokenizer.json"), docs, tk.TRAINED_EOS)
    assert np.array_equal(all_tokens(cut), ref), f"seed {seed}"


def _llama3_style_tokenizer(path: str, docs: list) -> None:
    """A tokenizer.json built like Llama 3's: its split regex, byte-level without its own regex, and the special
    tokens <|begin_of_text|> / <|end_of_text|> (the real one cannot be downloaded here)."""
    pattern = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
    t = tokenizers.Tokenizer(tokenizers.models.BPE())
    t.pre_tokenizer = tokenizers.pre_tokenizers.Sequence([
        tokenizers.pre_tokenizers.Split(tokenizers.Regex(pattern), behavior="isolated"),
        tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    t.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=500, show_progress=False,
                                             special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    t.train_from_iterator(docs, trainer)
    t.save(path)


def test_a_given_tokenizer_json_with_llama3_pre_tokenization(tmp_path, seed, monkeypatch):
    docs = make_corpus(str(tmp_path / "corpus"), seed, text_files=4, jsonl_docs=20)
    tj = str(tmp_path / "llama3_style.json")
    _llama3_style_tokenizer(tj, docs)
    monkeypatch.setattr(tk, "TEXT_PIECE_CHARS", 80)
    out = str(tmp_path / "tok")
    meta = tk.tokenize(tk.Settings(inputs=[str(tmp_path / "corpus")], out=out, tokenizer=tj, progress=False),
                       say=quiet)
    assert meta["tokenizer"]["eos_token"] == "<|end_of_text|>" and meta["tokenizer"]["trained"] is False
    assert meta["tokenizer"]["sha256"] == tk._sha256(tj)
    assert np.array_equal(all_tokens(out), reference_tokens(tj, docs, "<|end_of_text|>")), f"seed {seed}"


def test_a_large_vocabulary_gets_uint32_shards(tmp_path):
    words = {f"w{i}": i for i in range(70_000)}
    words["[UNK]"], words["</s>"] = 70_000, 70_001
    t = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="[UNK]"))
    t.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tj = str(tmp_path / "wl.json")
    t.save(tj)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "doc.txt").write_text("w69999 w3 nope w65536")
    meta = tk.tokenize(tk.Settings(inputs=[str(tmp_path / "c")], out=str(tmp_path / "o"), tokenizer=tj,
                                   progress=False), say=quiet)
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 70_002
    assert all_tokens(str(tmp_path / "o")).tolist() == [69999, 3, 70_000, 65536, 70_001]



def test_an_empty_text_is_a_document_and_an_empty_line_or_null_is_none(tmp_path):
    """A JSONL record whose text is "" ends with the end-of-text token like an empty text file; an empty line and a
    null text are no document (the random corpora above hit the first case now and then)."""
    words = {"a": 0, "b": 1, "[UNK]": 2, "</s>": 3}
    t = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="[UNK]"))
    t.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tj = str(tmp_path / "wl.json")
    t.save(tj)
    (tmp_path / "c").mkdir()
    lines = ['{"text": "a b"}', '{"text": ""}', "", '{"text": null}', '{"text": "b"}']
    (tmp_path / "c" / "d.jsonl").write_text("\n".join(lines) + "\n")
    meta = tk.tokenize(tk.Settings(inputs=[str(tmp_path / "c")], out=str(tmp_path / "o"), tokenizer=tj,
                                   eos_token="</s>", progress=False), say=quiet)
    assert meta["num_documents"] == 3
    assert all_tokens(str(tmp_path / "o")).tolist() == [0, 1, 3, 3, 1, 3]

def _cli(args, env_extra=None, timeout=300):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(env_extra or {})
    p = subprocess.run([sys.executable, "-m", "prime.tokenize", *args], env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=timeout)
    return p.returncode, p.stdout + p.stderr


def test_an_interrupted_tokenization_resumes_to_the_same_bytes(tmp_path, seed):
    """Stopped after 2 shards (the fault point tokenize.after_shard), with a half-written shard and a truncated one
    left behind, the same command finishes the rest; the result equals an uninterrupted run's."""
    make_corpus(str(tmp_path / "corpus"), seed, jsonl_docs=60)
    args = [str(tmp_path / "corpus"), "--vocab-size", "300", "--shard-size-mb", "0.001", "--workers", "1"]
    rc, out = _cli(args + ["--out", str(tmp_path / "whole")])
    assert rc == 0, out
    assert "train on it: --data.source bin --data.path" in out
    part = str(tmp_path / "part")
    rc, out = _cli(args + ["--out", part], {"PRIME_FAULTS": "tokenize.after_shard@2"})
    assert rc == 17, out
    assert not os.path.exists(os.path.join(part, META_FILE))
    with pytest.raises(ValueError, match="unfinished prime-tokenize run"):
        load_source("bin", part)
    done = sorted(n for n in os.listdir(part) if n.endswith(".bin"))
    assert done == ["shard_00000.bin", "shard_00001.bin"]
    with open(os.path.join(part, "shard_00001.bin"), "r+b") as f:  # damaged after it was recorded: redone
        f.truncate(6)
    with open(os.path.join(part, "shard_00002.bin.tmp"), "wb") as f:  # a shard cut by the interruption
        f.write(b"\1\2\3")
    rc, out = _cli(args + ["--out", part])
    assert rc == 0, out
    assert "resuming" in out and "1 of" in out  # only shard 0 was kept
    whole = str(tmp_path / "whole")
    a, b = read_metadata(whole), read_metadata(part)
    for m in (a, b):
        m.pop("created")
    assert a == b
    for s in a["shards"]:
        with open(os.path.join(whole, s["file"]), "rb") as f1, open(os.path.join(part, s["file"]), "rb") as f2:
            assert f1.read() == f2.read(), s["file"]
    assert not [n for n in os.listdir(part) if n.endswith(".tmp")]
    rc, out = _cli(args[:1] + ["--vocab-size", "301", "--out", part])  # other settings: refused, nothing touched
    assert rc == 2 and "--overwrite" in out, out


def test_bad_inputs_are_named(tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "d.jsonl").write_text(json.dumps({"body": "hello"}) + "\n")
    rc, out = _cli([str(tmp_path / "c"), "--out", str(tmp_path / "o"), "--vocab-size", "300"])
    assert rc == 2 and "no field 'text'" in out and "--jsonl-field" in out and "d.jsonl" in out, out
    rc, out = _cli([str(tmp_path / "c"), "--out", str(tmp_path / "o")])
    assert rc == 2 and "--tokenizer" in out and "--vocab-size" in out, out
    rc, out = _cli([str(tmp_path / "missing"), "--out", str(tmp_path / "o"), "--vocab-size", "300"])
    assert rc == 2 and "is not a file or a directory" in out, out
    (tmp_path / "c" / "d.jsonl").write_text(json.dumps({"text": 5}) + "\n")
    with pytest.raises(tk.TokenizeError, match="is a int, not text"):
        tk.tokenize(tk.Settings(inputs=[str(tmp_path / "c")], out=str(tmp_path / "o2"), vocab_size=300,
                                progress=False), say=quiet)
    t = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    t.save(str(tmp_path / "noeos.json"))
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "x.txt").write_text("a a")
    with pytest.raises(tk.TokenizeError, match="--eos-token"):
        tk.tokenize(tk.Settings(inputs=[str(tmp_path / "t")], out=str(tmp_path / "o3"),
                                tokenizer=str(tmp_path / "noeos.json"), progress=False), say=quiet)


def test_parquet_without_pyarrow_is_one_clear_error(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_pyarrow(name, *a, **k):
        if name.startswith("pyarrow"):
            raise ImportError("No module named 'pyarrow'")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "x.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(tk.TokenizeError, match="Parquet needs pyarrow.*pip install pyarrow"):
        tk.tokenize(tk.Settings(inputs=[str(tmp_path / "c")], out=str(tmp_path / "o"), vocab_size=300,
                                progress=False), say=quiet)


# -- training reads what prime-tokenize wrote ----------------------------------------------


@pytest.fixture
def tokenized(tmp_path, seed):
    make_corpus(str(tmp_path / "corpus"), seed, text_files=4, jsonl_docs=60)
    out = str(tmp_path / "tok")
    tk.tokenize(tk.Settings(inputs=[str(tmp_path / "corpus")], out=out, vocab_size=320, shard_size_mb=0.002,
                            progress=False), say=quiet)
    return out


def test_config_takes_the_vocabulary_from_the_data_and_refuses_a_smaller_one(tokenized):
    vocab = read_metadata(tokenized)["vocab_size"]
    assert 257 < vocab <= 320
    base = [("data.source", "bin"), ("data.path", tokenized), ("data.seq_len", "32")]
    cfg = load_config(None, base).validate()
    assert cfg.model.vocab_size == vocab and cfg.model.args().vocab_size == vocab
    with pytest.raises(ValueError) as info:
        load_config(None, base + [("model.vocab_size", "257")]).validate()
    assert "257" in str(info.value) and str(vocab) in str(info.value) and "meta.json" in str(info.value)
    assert load_config(None, base + [("model.vocab_size", "576")]).validate().model.args().vocab_size == 576
    with pytest.raises(ValueError, match="uint16"):
        load_source("bin", tokenized, "uint32")
    src = load_source("bin", tokenized, "auto")
    assert src.vocab_size == vocab and src.arrays[0].dtype == np.uint16 and f"vocabulary {vocab}" in src.description


def test_a_damaged_shard_is_named(tokenized):
    meta = read_metadata(tokenized)
    victim = os.path.join(tokenized, meta["shards"][1]["file"])
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) - 2)
    with pytest.raises(ValueError, match="shard_00001.bin has .* bytes, meta.json says"):
        load_source("bin", tokenized)
    os.remove(victim)
    with pytest.raises(ValueError, match="shard_00001.bin is missing"):
        load_source("bin", tokenized)
    with open(os.path.join(tokenized, META_FILE), "w") as f:
        f.write("{}")
    with pytest.raises(ValueError, match="not a prime-tokenize metadata file"):
        load_source("bin", tokenized)
