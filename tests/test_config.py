"""Config: TOML + environment + command line, types, and errors that name the field and the value."""

import dataclasses
import glob
import os

import pytest

from prime.config import Config, _field_docs, config_from_argv, describe, load_config, model_layers, parse_cli

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
    assert cfg.diloco.outer_momentum is None and cfg.diloco.outer_settings()["outer_momentum"] == 0.9  # default
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
    (("diloco.codec", "fp8"), "diloco.codec must be 'int8', 'fp4', 'topk' or 'none', got 'fp8'"),
    (("diloco.block_size", "100"), "diloco.block_size must be a power of two from 32 to 4096, got 100"),
    (("optim.lr", "-1"), "optim.lr must be > 0, got -1.0"),
    (("train.compile", "maybe"), "train.compile must be a bool, got 'maybe'"),
    (("train.device", "tpu"), "train.device must be 'auto', 'cpu' or 'cuda', got 'tpu'"),
    (("nodes.node_rank", "2"), "nodes.node_rank must be in [0, 0], got 2"),
    (("nodes.store_addr", "nohost"), "nodes.store_addr must be host:port, got 'nohost'"),
    (("model.n_heads", "5"), "model.dim (192) must be divisible by model.n_heads (5)"),
    (("model.vocab_size", "100"), "model.vocab_size must be >= 256 for byte-level data"),
    (("data.seq_len", "5000"), "data.seq_len (5000) exceeds model.max_seq_len (1024)"),
    (("diloco.phase", "tokens"), "diloco.phase must be 'steps' or 'time', got 'tokens'"),
    (("diloco.phase", "time"), "diloco.phase_seconds must be > 0 with diloco.phase = 'time', got 0.0"),
    (("diloco.phase_seconds", "30"), "diloco.phase_seconds must be 0 (unset) unless diloco.phase = 'time', got 30.0"),
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


def _numeric_fields(kind):
    """(section.field) of every field whose type is `kind` (float or int), Optional included."""
    import typing

    out = []
    for sec in dataclasses.fields(Config):
        for name, tp in typing.get_type_hints(sec.default_factory).items():
            if tp is kind or kind in typing.get_args(tp):
                out.append(f"{sec.name}.{name}")
    return out


@pytest.mark.parametrize("dotted", _numeric_fields(float))
@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
def test_every_float_field_must_be_finite(dotted, value):
    with pytest.raises(ValueError) as info:
        load_config(None, [(dotted, value)], env={}).validate()
    assert f"{dotted} must be a finite number, got {float(value)!r}" in str(info.value)


@pytest.mark.parametrize("dotted", _numeric_fields(int))
def test_every_int_field_must_fit_int64(dotted):
    with pytest.raises(ValueError) as info:
        load_config(None, [(dotted, str(2**63))], env={}).validate()
    assert f"{dotted} must fit a 64-bit integer, got {2**63}" in str(info.value)


def test_there_are_numeric_fields_to_check():
    floats = _numeric_fields(float)
    assert {"optim.lr", "optim.eps", "model.rope_theta", "diloco.outer_lr", "diloco.timeout_s",
            "diloco.max_rate_mbit", "elastic.heartbeat_timeout_s"} <= set(floats), floats
    assert {"diloco.streams", "diloco.retries", "train.seed"} <= set(_numeric_fields(int))


@pytest.mark.parametrize("override,message", [
    (("optim.lr", "1e30"), "optim.lr must be <= 1"),
    (("optim.eps", "10"), "optim.eps must be <= 0.01"),
    (("optim.weight_decay", "1e5"), "optim.weight_decay must be < 1 / optim.lr"),
    (("diloco.outer_lr", "1e30"), "diloco.outer_lr must be <= 10"),
    (("diloco.timeout_s", "1e-9"), "diloco.timeout_s must be in [1, 86400] seconds, got 1e-09"),
    (("diloco.timeout_s", "1e12"), "diloco.timeout_s must be in [1, 86400] seconds, got 1000000000000.0"),
    (("diloco.streams", "1000"), "diloco.streams must be in [0, 64]"),
    (("diloco.retries", "1000000"), "diloco.retries must be in [0, 100]"),
    (("diloco.max_rate_mbit", "1e-9"), "diloco.max_rate_mbit must be in [0.1, 1e+06] Mbit/s (or 0: unlimited)"),
    (("train.seed", "-1"), "train.seed must be in [0, 9223372036854775807], got -1"),
    (("train.threads", "100000"), "train.threads must be in [0, 4096]"),
    (("metrics.peak_tflops", "1e30"), "metrics.peak_tflops must be in [0, 1e+06] TFLOP/s"),
    (("elastic.heartbeat_interval_s", "1e-6"), "elastic.heartbeat_interval_s must be in [0.01, 60] seconds"),
    (("elastic.barrier_timeout_s", "0.001"), "elastic.barrier_timeout_s must be in [1, 86400] seconds"),
    (("elastic.join_timeout_s", "1e20"), "elastic.join_timeout_s must be in [1, 86400] seconds"),
    (("elastic.transfer_max_rate_mbit", "1e-5"), "elastic.transfer_max_rate_mbit must be in [0.1, 1e+06]"),
    (("elastic.max_attempts", "1000"), "elastic.max_attempts must be in [1, 100]"),
    (("model.rope_theta", "-5"), "model.rope_theta must be > 0"),
])
def test_absurd_values_name_the_field(override, message):
    with pytest.raises(ValueError) as info:
        load_config(None, [override], env={}).validate()
    assert message in str(info.value)


@pytest.mark.parametrize("override", [
    ("optim.lr", "1"), ("optim.eps", "1e-2"), ("diloco.outer_lr", "10"), ("diloco.timeout_s", "1"),
    ("diloco.timeout_s", "86400"), ("diloco.streams", "64"), ("diloco.max_rate_mbit", "0"),
    ("diloco.max_rate_mbit", "0.1"), ("train.seed", str(2**63 - 1)), ("elastic.heartbeat_interval_s", "0.2"),
])
def test_the_ends_of_each_range_are_accepted(override):
    load_config(None, [override], env={}).validate()


def _layers_by_hand(args):
    """The layers diloco.fragments cuts a model into, counted from the shape: one per block, the embedding, the final
    norm and the output projection unless it is tied to the embedding."""
    return args.n_layers + 2 + (0 if args.tie_embeddings else 1)


@pytest.mark.parametrize("argv", [["--model.name", "tiny"], ["--model.name", "tiny", "--model.n_layers", "2"],
                                  ["--model.name", "1B"], ["--model.name", "tiny", "--model.tie_embeddings", "true"]])
def test_fragments_above_the_models_layers_are_refused_naming_the_field(argv):
    """diloco.fragments above the model's layers is refused at validation (prime-simulate's pre-check, before any node
    starts), naming the field and the count, which is the one the runtime cut (prime.fragments.split_fragments) has."""
    import torch

    from prime.fragments import layer_units
    from prime.model import Transformer

    base = argv + ["--data.seq_len", "64"]
    args = config_from_argv(base).model.args()
    n = _layers_by_hand(args)
    with torch.device("meta"):
        names = [name for name, _ in Transformer(args).named_parameters()]
    assert len(layer_units(names)) == n  # the runtime's count
    assert [unit for unit, _ in layer_units(names)] == model_layers(args)  # the config's, without the model
    assert config_from_argv(base + ["--diloco.fragments", str(n)]).diloco.fragments == n  # as many as layers: fine
    with pytest.raises(ValueError) as info:
        config_from_argv(base + ["--diloco.fragments", str(n + 1)])
    assert f"diloco.fragments ({n + 1}) is more than the model's {n} layers" in str(info.value)


def test_checkpoint_every_without_dir_says_nothing_is_saved(capsys):
    """checkpoint.every without checkpoint.dir writes nothing: build_checkpoints says so in one line naming both fields,
    on the node's logging process only; checkpoint.every = 0 (the default) without dir says nothing."""
    import torch

    from prime.builders import build_checkpoints
    from prime.runtime import Environment

    logger, other = (Environment(torch.device("cpu"), rank, 2, 0, 1, fsdp=False) for rank in (0, 1))
    assert Config().checkpoint.every == 0 and Config().checkpoint.dir == ""  # the defaults: no warning
    cfg = config_from_argv(["--checkpoint.every", "2"])
    said = []
    assert build_checkpoints(cfg, logger, None, None, None, say=said.append) is None
    assert len(said) == 1 and "checkpoint.every = 2" in said[0] and "checkpoint.dir is not set" in said[0], said
    assert build_checkpoints(cfg, other, None, None, None, say=said.append) is None and len(said) == 1
    assert build_checkpoints(Config(), logger, None, None, None, say=said.append) is None and len(said) == 1
    build_checkpoints(cfg, logger, None, None, None)  # the trainer's call: the line goes to stderr
    err = capsys.readouterr().err
    assert err.count("checkpoint.every = 2 but checkpoint.dir is not set") == 1, err
