"""Config: TOML + environment + command line, types, and errors that name the field and the value."""

import dataclasses
import glob
import os

import pytest

from prime.config import Config, _field_docs, config_from_argv, describe, load_config, parse_cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write(tmp_path, text):
    p = tmp_path / "run.toml"
    p.write_text(text)
    return str(p)


def test_precedence_default_toml_env_cli(tmp_path):
    path = write(tmp_path, "[diloco]\ninner_steps = 20\nouter_lr = 0.5\n[nodes]\nnum_nodes = 2\n")
    cfg = load_config(path, [("diloco.inner_steps", "50")], env={"PRIME_NUM_NODES": "4", "PRIME_NODE_RANK": "3"})
    assert cfg.diloco.inner_steps == 50  # command line over TOML
    assert cfg.diloco.outer_lr == 0.5  # TOML over default
    assert cfg.diloco.outer_momentum == 0.9  # default
    assert (cfg.nodes.num_nodes, cfg.nodes.node_rank) == (4, 3)  # environment over TOML
    cfg.validate()


def test_cli_forms_and_aliases():
    path, overrides, want_help = parse_cli(
        ["--config", "x.toml", "--diloco.inner_steps", "5", "--optim.lr=1e-3", "--node-rank", "1", "--num-nodes=2",
         "--store-addr", "10.0.0.1:29600"]
    )
    assert path == "x.toml" and not want_help
    assert overrides == [("diloco.inner_steps", "5"), ("optim.lr", "1e-3"), ("nodes.node_rank", "1"),
                         ("nodes.num_nodes", "2"), ("nodes.store_addr", "10.0.0.1:29600")]
    cfg = load_config(None, overrides, env={}).validate()
    assert cfg.optim.lr == 1e-3 and cfg.nodes.store_host == "10.0.0.1" and cfg.nodes.store_port == 29600


def test_types_are_converted():
    cfg = load_config(None, [("train.compile", "true"), ("model.dim", "none"), ("model.n_layers", "3"),
                             ("diloco.outer_lr", "1")], env={})
    assert cfg.train.compile is True and cfg.model.dim is None and cfg.model.n_layers == 3
    assert isinstance(cfg.diloco.outer_lr, float)


@pytest.mark.parametrize("override,message", [
    (("diloco.inner_steps", "0"), "diloco.inner_steps must be >= 1, got 0"),
    (("diloco.inner_steps", "ten"), "diloco.inner_steps must be an int, got 'ten'"),
    (("diloco.outer_momentum", "1.5"), "diloco.outer_momentum must be in [0, 1), got 1.5"),
    (("diloco.codec", "fp8"), "diloco.codec must be 'int8' or 'none', got 'fp8'"),
    (("diloco.block_size", "100"), "diloco.block_size must be a power of two from 32 to 4096, got 100"),
    (("optim.lr", "-1"), "optim.lr must be > 0, got -1.0"),
    (("train.compile", "maybe"), "train.compile must be a bool, got 'maybe'"),
    (("train.device", "tpu"), "train.device must be 'auto', 'cpu' or 'cuda', got 'tpu'"),
    (("nodes.node_rank", "2"), "nodes.node_rank must be in [0, 0], got 2"),
    (("nodes.store_addr", "nohost"), "nodes.store_addr must be host:port, got 'nohost'"),
    (("model.n_heads", "5"), "model.dim (192) must be divisible by model.n_heads (5)"),
    (("model.vocab_size", "100"), "model.vocab_size must be >= 256 for byte-level data"),
    (("data.seq_len", "5000"), "data.seq_len (5000) exceeds model.max_seq_len (1024)"),
    (("diloco.nope", "1"), "unknown config field 'diloco.nope'; diloco has"),
    (("nope.x", "1"), "unknown config field 'nope.x'"),
])
def test_bad_values_name_field_and_value(override, message):
    with pytest.raises(ValueError) as info:
        load_config(None, [override], env={}).validate()
    assert message in str(info.value)


def test_missing_data_path_is_a_clear_error(tmp_path):
    missing = str(tmp_path / "does-not-exist")
    with pytest.raises(ValueError, match="does not exist or is not a directory"):
        load_config(None, [("data.source", "bin"), ("data.path", missing)], env={}).validate()
    with pytest.raises(ValueError, match="data.path must name a directory"):
        load_config(None, [("data.source", "text")], env={}).validate()


def test_bad_toml_and_missing_file(tmp_path):
    with pytest.raises(ValueError, match="is not valid TOML"):
        load_config(write(tmp_path, "[diloco\n"), env={})
    with pytest.raises(ValueError, match="does not exist"):
        load_config(str(tmp_path / "nope.toml"), env={})
    with pytest.raises(ValueError, match="unknown config field 'diloco.inner'"):
        load_config(write(tmp_path, "[diloco]\ninner = 3\n"), env={})


def test_every_field_is_documented():
    for sec in dataclasses.fields(Config):
        cls = sec.default_factory
        docs = _field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in docs]
        assert not missing, f"[{sec.name}] fields without a doc line: {missing}"
    text = describe()
    assert "[diloco]" in text and "inner_steps (int, default 100)" in text


def test_shipped_configs_validate():
    files = sorted(glob.glob(os.path.join(ROOT, "configs", "*.toml")))
    assert files
    for path in files:
        cfg = load_config(path, env={})
        if cfg.data.source != "embedded":  # their data is not on this machine; the rest must still be valid
            cfg.data.source, cfg.data.path = "embedded", ""
            cfg.model.vocab_size = max(cfg.model.args().vocab_size, 256)
        cfg.validate()


def test_help_exits_zero(capsys):
    with pytest.raises(SystemExit) as info:
        config_from_argv(["--help"])
    assert info.value.code == 0
    assert "[diloco]" in capsys.readouterr().out


def test_docs_list_every_field():
    with open(os.path.join(ROOT, "docs", "training.md")) as f:
        doc = f.read()
    for sec in dataclasses.fields(Config):
        assert f"### [{sec.name}]" in doc
        for f in dataclasses.fields(sec.default_factory):
            assert f"| `{f.name}` |" in doc, f"docs/training.md lacks {sec.name}.{f.name}"
