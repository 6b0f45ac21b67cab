"""The Llama-style model: shapes, parameter and FLOP counts, causality, RoPE, norm, and that it learns."""

import random

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from prime.model import PRESETS, ModelArgs, RMSNorm, Transformer, apply_rope, preset, rope_tables


@pytest.fixture(autouse=True)
def one_thread():
    # On a loaded 2-core machine torch's second OpenMP thread makes tiny ops ~30x slower.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def seed():
    s = random.randrange(2**31)
    print(f"seed {s}")
    torch.manual_seed(s)
    return s


SMALL = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=100, max_seq_len=64)


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("kv", [1, 2, 4])
def test_param_count_matches_module(tie, kv):
    args = ModelArgs(**dict(SMALL, n_kv_heads=kv, tie_embeddings=tie))
    model = Transformer(args)
    assert model.num_params() == args.num_params()


def test_presets_build_on_meta_with_their_counts():
    for name, args in PRESETS.items():
        with torch.device("meta"):
            model = Transformer(args)
        assert model.num_params() == args.num_params(), name
    # INTELLECT-1's shape is a 10B model (10.2B with untied Llama-3 embeddings)
    assert 10.0e9 < PRESETS["10B"].num_params() < 10.4e9
    assert 1.1e9 < PRESETS["1B"].num_params() < 1.4e9
    assert 0.12e9 < PRESETS["150M"].num_params() < 0.18e9


@pytest.mark.parametrize("tie", [False, True])
def test_flops_per_token_matches_flop_counter(tie, seed):
    """ModelArgs.flops_per_token against torch's FLOP counter over a forward and backward."""
    args = ModelArgs(**dict(SMALL, tie_embeddings=tie))
    model = Transformer(args)
    bsz, seq = 2, 32
    x = torch.randint(0, args.vocab_size, (bsz, seq))
    # The math backend spells attention as matmuls the counter sees (all T x T of them, as
    # the 12 * L * d * T term assumes); the fused CPU kernel would be invisible to it.
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(x).sum().backward()
    measured = counter.get_total_flops() / (bsz * seq)
    assert measured == pytest.approx(args.flops_per_token(seq), rel=0.01)


def test_causal(seed):
    """Changing token t changes no logit before t."""
    model = Transformer(ModelArgs(**SMALL))
    x = torch.randint(0, 100, (1, 20))
    y = x.clone()
    y[0, 12] = (y[0, 12] + 1) % 100
    with torch.no_grad():
        a, b = model(x), model(y)
    assert torch.equal(a[0, :12], b[0, :12])
    assert not torch.allclose(a[0, 12:], b[0, 12:])


def test_rope_scores_depend_only_on_offset(seed):
    cos, sin = rope_tables(16, 64, 10000.0)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def score(m, n):
        qm = apply_rope(q.expand(1, 64, 1, 16).clone(), cos, sin)[0, m, 0]
        kn = apply_rope(k.expand(1, 64, 1, 16).clone(), cos, sin)[0, n, 0]
        return float(qm.double() @ kn.double())

    assert score(5, 2) == pytest.approx(score(40, 37), rel=1e-4, abs=1e-5)
    assert score(0, 0) == pytest.approx(float(q.flatten().double() @ k.flatten().double()), rel=1e-5)


def test_rmsnorm_against_float64(seed):
    norm = RMSNorm(32, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(32))
    x = torch.randn(4, 32)
    xd = x.double()
    ref = xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.double()
    torch.testing.assert_close(norm(x).double(), ref, rtol=1e-5, atol=1e-6)


def test_gqa_equals_mha_with_repeated_kv_weights(seed):
    """Grouped-query attention is multi-head attention whose K/V heads are shared by groups of query heads."""
    gqa = Transformer(ModelArgs(**dict(SMALL, n_kv_heads=2)))
    mha = Transformer(ModelArgs(**dict(SMALL, n_kv_heads=4)))
    sd = gqa.state_dict()
    hd = SMALL["dim"] // SMALL["n_heads"]
    for key in list(sd):
        if key.endswith("attention.wk.weight") or key.endswith("attention.wv.weight"):
            sd[key] = sd[key].view(2, hd, -1).repeat_interleave(2, dim=0).reshape(4 * hd, -1)
    mha.load_state_dict(sd)
    x = torch.randint(0, 100, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(gqa(x), mha(x), rtol=1e-5, atol=1e-5)


def test_learns_a_fixed_batch(seed):
    model = Transformer(ModelArgs(**SMALL))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randint(0, 100, (4, 33))
    losses = []
    for _ in range(30):
        loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("tie", [False, True])
def test_meta_init_then_init_weights(seed, tie):
    args = ModelArgs(**SMALL, tie_embeddings=tie)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")  # unties shared parameters: init_weights must tie them again
    model.init_weights()
    x = torch.randint(0, 100, (1, 8))
    assert torch.isfinite(model(x)).all()
    assert model.rope_cos.shape == (64, 8)
    assert (model.output.weight is model.tok_embeddings.weight) == tie
    assert model.num_params() == args.num_params()
    # the same weights as a model built on the real device from the same seed
    ref = Transformer(args)
    for m in (model, ref):
        torch.manual_seed(1234)
        m.init_weights()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert torch.equal(p, q), n


@pytest.mark.parametrize("bad,match", [
    (dict(n_heads=5), "divisible by model.n_heads"),
    (dict(n_kv_heads=3), "n_kv_heads"),
    (dict(dim=0), "model.dim must be a positive integer, got 0"),
    (dict(rope_theta=-1.0), "rope_theta"),
])
def test_bad_shapes(bad, match):
    with pytest.raises(ValueError, match=match):
        ModelArgs(**dict(SMALL, **bad)).validate()


def test_unknown_preset():
    with pytest.raises(ValueError, match="model.name must be one of"):
        preset("7B")
