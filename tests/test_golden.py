"""Golden vectors of the int8 block codec: every backend against committed hex.

The other codec tests compare each backend with the torch reference in prime/ops.py;
if the reference and a backend drifted together (an edit to both), they would still
pass. These vectors are fixed: they were printed by tools/golden_vectors.py, a second
reading of docs/wire-format.md in plain Python (no torch, nothing from prime), and
committed below as hex (GOLDEN). Every backend available here must reproduce them
bit for bit: the torch reference, the C++ CPU op and each CPU instruction set, Triton
(under TRITON_INTERPRET=1 in a subprocess on a CPU machine), CUDA and Triton on a GPU.

A few entries, derived by hand from the format (block size B = 32):

- Block 0 has max |x| = 15.875 = 127 * 2^-3 (three times, both signs), so
  scale = 15.875 / 127 = 0.125 (bits 3e000000) and inv = 127 / 15.875 = 8 exactly;
  x = (k + 0.5) / 8 gives v = k + 0.5, a tie, rounded to even:
  0.5 -> 0, -0.5 -> 0, 1.5 -> 2, -1.5 -> -2 (fe), 2.5 -> 2, -2.5 -> -2, 3.5 -> 4,
  125.5 -> 126 (7e), -126.5 -> -126 (82); the maxima give 127 (7f) and -127 (81),
  never -128; x = -0.0 gives 0.
- Block 2 holds 32 copies of fp32(-3.7): every q is -127 (81).
- Block 3 holds only zeros (some -0.0): a = 0, scale = 0, inv = 0, q = 0.
- Block 4 holds subnormals below 60 * 2^-149: 127 / a overflows, so inv = 0 and q = 0;
  scale = a / 127 is below half the smallest subnormal and rounds to 0.
- Block 6 holds -FLT_MAX: scale = FLT_MAX / 127 rounded up, so q = -127 decodes to
  -127 * scale = -inf (the ring's owner flags exactly this as an overflow).
- Block 7 holds a NaN and block 8 (7 values, the short last block) an infinity:
  scale 7fc00000 (the canonical quiet NaN, the flag) and q all 0.
- Stochastic rounding at element index i = 2^32 keys its generator by
  lo = 0 and hi = 1: k = fmix32(seed ^ fmix32(1 ^ 0x9e3779b9)); the vectors at
  first_index 2^32 - 64 cross that boundary after two blocks.

Run `python tools/golden_vectors.py` to print the literal again; the last tests check
that it still prints exactly GOLDEN, and that the ring's int8 payload is laid out as
docs/wire-format.md says: ceil(len/B) little-endian fp32 scales, then len int8 values.
"""

from __future__ import annotations

import importlib.util
import os
import struct
import subprocess
import sys

import pytest
import torch

from prime import _extension, ops

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_EXT = _extension.available()
HAS_CUDA = torch.cuda.is_available()
needs_ext = pytest.mark.skipif(not HAS_EXT, reason="prime._C is not built")


# ---------------------------------------------------------------------------
# hex <-> tensors


def _words(text: str) -> list[int]:
    return [int(w, 16) for w in text.split()]


def f32(text: str) -> torch.Tensor:
    """fp32 values from their bit patterns."""
    signed = [(u ^ 0x80000000) - 0x80000000 for u in _words(text)]
    return torch.tensor(signed, dtype=torch.int32).view(torch.float32)


def f16(text: str, dtype: torch.dtype) -> torch.Tensor:
    signed = [(u ^ 0x8000) - 0x8000 for u in _words(text)]
    return torch.tensor(signed, dtype=torch.int16).view(dtype)


def q8(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(bytes.fromhex(text)), dtype=torch.int8).clone()


def hex_of(t: torch.Tensor) -> str:
    """The golden spelling of a tensor: fp32 / 16-bit words, or q bytes."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.int8:
        return t.numpy().tobytes().hex()
    if t.dtype == torch.float32:
        return " ".join(f"{v & 0xFFFFFFFF:08x}" for v in t.view(torch.int32).tolist())
    return " ".join(f"{v & 0xFFFF:04x}" for v in t.view(torch.int16).tolist())


def assert_hex_equal(got: str, want: str, what: str) -> None:
    """Word-by-word, naming the first difference and its block."""
    if got == want:
        return
    if " " in want:
        g, w = got.split(), want.split()
    else:
        g, w = [got[i : i + 2] for i in range(0, len(got), 2)], [want[i : i + 2] for i in range(0, len(want), 2)]
    assert len(g) == len(w), f"{what}: {len(g)} values, golden has {len(w)}"
    bad = [i for i in range(len(w)) if g[i] != w[i]]
    i = bad[0]
    raise AssertionError(f"{what}: {len(bad)} of {len(w)} differ; first at element {i} (block {i // B}): "
                         f"got {g[i]}, golden {w[i]}")


def assert_floats_golden(got: torch.Tensor, want_hex: str, what: str) -> None:
    """Bit-exact, except that any NaN matches any NaN (the format leaves a decoded NaN's bits open)."""
    want = f32(want_hex) if got.dtype == torch.float32 else f16(want_hex, got.dtype)
    got = got.cpu()
    assert torch.equal(torch.isnan(got), torch.isnan(want)), f"{what}: NaN at other places"
    keep = ~torch.isnan(want)
    assert_hex_equal(hex_of(got[keep]), hex_of(want[keep]), what)


# ---------------------------------------------------------------------------
# the backends


class Impl:
    """One way to run the codec: a public backend on a device, or a named CPU instruction set."""

    def __init__(self, name: str, device: str, backend: str | None = None, isa: str | None = None):
        self.name, self.device, self.backend, self.isa = name, torch.device(device), backend, isa

    def quantize(self, x, seed=None):
        x = x.to(self.device)
        if self.isa:
            return torch.ops.prime._quantize_int8_isa(x, B, seed, self.isa)
        if self.backend == "torch":
            return ops.quantize_int8_reference(x, B, seed)
        return ops.quantize_int8(x, B, seed=seed, backend=self.backend, check_finite=False)

    def dequantize(self, q, s, dtype):
        q, s = q.to(self.device), s.to(self.device)
        if self.isa:
            return torch.ops.prime._dequantize_int8_isa(q, s, B, dtype, self.isa)
        if self.backend == "torch":
            return ops.dequantize_int8_reference(q, s, B, dtype)
        return ops.dequantize_int8(q, s, B, dtype, backend=self.backend)

    def dequantize_add_(self, acc, q, s):
        acc, q, s = acc.to(self.device), q.to(self.device), s.to(self.device)
        if self.isa:
            torch.ops.prime._dequantize_add_int8_isa_(acc, q, s, B, self.isa)
        elif self.backend == "torch":
            ops.dequantize_add_int8_reference_(acc, q, s, B)
        else:
            ops.dequantize_add_int8_(acc, q, s, B, backend=self.backend)
        return acc

    def __repr__(self):
        return self.name


def _triton_interpreted() -> bool:
    try:
        return "triton" in ops.available_backends("cpu")
    except Exception:  # a broken triton install: the subprocess test reports it
        return False


def _impls() -> list:
    out = [pytest.param(Impl("torch", "cpu", backend="torch"), id="torch")]
    if HAS_EXT:
        out.append(pytest.param(Impl("cpu", "cpu", backend="cpu"), id="cpu"))
        out += [pytest.param(Impl(f"cpu-{i}", "cpu", isa=i), id=f"cpu-{i}") for i in torch.ops.prime._cpu_codec_isas()]
    if _triton_interpreted():
        out.append(pytest.param(Impl("triton", "cpu", backend="triton"), id="triton-cpu"))
    if HAS_CUDA:
        for backend in ops.available_backends("cuda"):
            if backend != "torch":
                out.append(pytest.param(Impl(f"{backend}-cuda", "cuda", backend=backend), id=f"{backend}-cuda"))
    return out


IMPLS = _impls()
B = 32  # GOLDEN["block_size"]; asserted in test_generator_prints_the_committed_vectors


# ---------------------------------------------------------------------------
# encoding and decoding


@pytest.mark.parametrize("impl", IMPLS)
def test_quantize_matches_golden(impl):
    g = GOLDEN["fp32"]
    q, s = impl.quantize(f32(g["x"]))
    assert_hex_equal(hex_of(s), g["scales"], f"{impl} scales")
    assert_hex_equal(hex_of(q), g["q"], f"{impl} q")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("impl", IMPLS)
def test_quantize_half_inputs_match_golden(impl, dtype):
    g = GOLDEN[str(dtype).removeprefix("torch.")]
    q, s = impl.quantize(f16(g["x"], dtype))
    assert_hex_equal(hex_of(s), g["scales"], f"{impl} {dtype} scales")
    assert_hex_equal(hex_of(q), g["q"], f"{impl} {dtype} q")


@pytest.mark.parametrize("impl", IMPLS)
def test_decode_matches_golden(impl):
    g = GOLDEN["fp32"]
    q, s = q8(g["q"]), f32(g["scales"])
    for dtype, key in [(torch.float32, "decoded_fp32"), (torch.bfloat16, "decoded_bf16"),
                       (torch.float16, "decoded_fp16")]:
        assert_floats_golden(impl.dequantize(q, s, dtype), g[key], f"{impl} dequantize -> {dtype}")
    acc = impl.dequantize_add_(f32(g["acc"]), q, s)
    assert_floats_golden(acc, g["acc_plus_decoded"], f"{impl} dequantize_add")


@pytest.mark.parametrize("impl", IMPLS)
def test_stochastic_rounding_matches_golden(impl):
    g = GOLDEN["stochastic"]
    x = f32(g["x"])
    for key, want in g["q"].items():
        seed, first = (int(v) for v in key.split("@"))
        if first:
            continue  # a tensor starts at element 0; offsets: the tests below
        q, s = impl.quantize(x, seed)
        assert_hex_equal(hex_of(s), g["scales"], f"{impl} seed {seed} scales")
        assert_hex_equal(hex_of(q), want, f"{impl} seed {seed} q")


# ---------------------------------------------------------------------------
# stochastic rounding at element indices up to 2^63 - 1


def test_hash_matches_golden():
    """The generator itself, as the reference computes it: u = (h >> 8) * 2^-24."""
    for key, h in GOLDEN["hash"].items():
        seed, index = (int(v) for v in key.split("@"))
        u = ops.stochastic_uniform_reference(seed, torch.tensor([index], dtype=torch.int64))
        assert u.item() == (int(h, 16) >> 8) * 2.0**-24, f"seed {seed} index {index}: u {u.item()!r}, golden h {h}"


def _offset_cases():
    g = GOLDEN["stochastic"]
    for key, want in g["q"].items():
        seed, first = (int(v) for v in key.split("@"))
        yield seed, first, want


def test_reference_at_high_indices_matches_golden():
    x = f32(GOLDEN["stochastic"]["x"])
    for seed, first, want in _offset_cases():
        q, _ = ops.quantize_int8_reference(x, B, seed, first_index=first)
        assert_hex_equal(hex_of(q), want, f"reference seed {seed} first_index {first}")


@needs_ext
def test_cpu_codec_at_high_indices_matches_golden():
    """The C++ kernels with a global element offset (the ring's and the ops' code path)."""
    x = f32(GOLDEN["stochastic"]["x"])
    for seed, first, want in _offset_cases():
        q, s = _extension.require()._codec_quantize_at(x, B, seed, first)
        assert_hex_equal(hex_of(s), GOLDEN["stochastic"]["scales"], f"C++ seed {seed} first_index {first}")
        assert_hex_equal(hex_of(q), want, f"C++ seed {seed} first_index {first}")


@pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU")
def test_gpu_backends_beyond_2_to_the_32_match_golden():
    """CUDA and Triton keep no offset argument: a tensor of 2^32 + 64 fp32 values holds the
    golden input at element 2^32 - 64, so its blocks straddle index 2^32."""
    first = 2**32 - 2 * B
    g = GOLDEN["stochastic"]
    x_small = f32(g["x"])
    n = first + x_small.numel()
    need = n * 5 + (1 << 30)
    if torch.cuda.mem_get_info()[0] < need:
        pytest.skip(f"needs {need / 2**30:.0f} GiB of free GPU memory")
    x = torch.zeros(n, device="cuda")
    x[first:] = x_small.cuda()
    for backend in ops.available_backends("cuda"):
        if backend == "torch":
            continue
        for seed in (s for s, f, _ in _offset_cases() if f == first):
            q, s = ops.quantize_int8(x, B, seed=seed, backend=backend, check_finite=False)
            assert_hex_equal(hex_of(q[first:]), g["q"][f"{seed}@{first}"], f"{backend} seed {seed}")
            assert_hex_equal(hex_of(s[first // B :]), g["scales"], f"{backend} seed {seed} scales")
            del q, s


@pytest.mark.skipif(_triton_interpreted(), reason="the Triton cases already run in this process")
def test_triton_interpreted_in_subprocess():
    """Triton on the CPU needs TRITON_INTERPRET=1 before triton's first import (see tests/test_triton.py)."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in [ROOT, env.get("PYTHONPATH")] if p)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.abspath(__file__), "-k", "triton"]
    run = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    out = run.stdout + run.stderr
    assert run.returncode == 0, f"{' '.join(cmd)}:\n{out[-6000:]}"
    summary = out.strip().splitlines()[-1]
    assert "passed" in summary and "failed" not in summary, summary
    assert int(summary.split(" passed")[0].split()[-1]) >= 5, summary  # the four golden tests + bf16/fp16


# ---------------------------------------------------------------------------
# the vectors themselves


def _generator():
    spec = importlib.util.spec_from_file_location("golden_vectors", os.path.join(ROOT, "tools", "golden_vectors.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generator_prints_the_committed_vectors():
    """tools/golden_vectors.py (the spec in plain Python) still derives exactly the committed hex."""
    assert GOLDEN["block_size"] == B
    assert _generator().build() == GOLDEN


def test_hand_derived_entries():
    """The entries derived by hand in this module's docstring."""
    g = GOLDEN["fp32"]
    scales = g["scales"].split()
    q = bytes.fromhex(g["q"])
    assert scales[0] == "3e000000" and f32(scales[0]).item() == 0.125
    x0 = f32(g["x"])[:B].tolist()
    expected = {0.5: 0, -0.5: 0, 1.5: 2, -1.5: -2, 2.5: 2, -2.5: -2, 3.5: 4, 125.5: 126, -126.5: -126,
                127.0: 127, -127.0: -127}
    seen = set()
    for j, x in enumerate(x0):
        v = x * 8
        if v in expected:
            assert int.from_bytes(q[j : j + 1], "little", signed=True) == expected[v], (j, x)
            seen.add(v)
    assert seen == set(expected)
    assert q[2 * B : 3 * B] == b"\x81" * B  # all equal: -127
    assert scales[3] == "00000000" and q[3 * B : 4 * B] == bytes(B)  # zeros
    assert scales[4] == "00000000" and q[4 * B : 5 * B] == bytes(B)  # subnormals: 127 / a overflows
    assert scales[7] == scales[8] == "7fc00000" and q[7 * B :] == bytes(len(q) - 7 * B)  # the flag
    assert 0x81 in q and 0x80 not in q  # -127 occurs, -128 never


# ---------------------------------------------------------------------------
# the ring's payload: docs/wire-format.md "On the wire", built by hand


def int8_payload_by_hand(scales_hex: str, q_hex: str) -> bytes:
    """ceil(len/B) fp32 scales, little-endian, then the len int8 values."""
    return b"".join(struct.pack("<I", u) for u in _words(scales_hex)) + bytes.fromhex(q_hex)


@needs_ext
def test_ring_int8_payload_layout():
    C = _extension.require()
    g = GOLDEN["fp32"]
    x = f32(g["x"])
    payload, finite = C._ring_encode_input(x, "int8", B)
    assert not finite  # blocks 7 and 8 hold NaN / Inf: the ring refuses to send this data
    assert payload == int8_payload_by_hand(g["scales"], g["q"])
    assert len(payload) == ops.wire_bytes(x.numel(), B) == x.numel() + 4 * 9
    # the owner's final value: encoded the same way, and decoded as the format says
    m = 6 * B  # blocks 0-5; block 6 (a = FLT_MAX) decodes to -inf: -127 * fp32(FLT_MAX / 127) overflows
    scales6, q6 = " ".join(g["scales"].split()[:6]), g["q"][: 2 * m]
    payload, finite = C._ring_encode_final(x[:m].contiguous(), "float32", "int8", B)
    assert finite and payload == int8_payload_by_hand(scales6, q6)
    out = C._ring_decode_final(payload, torch.empty(m), "int8", B)
    assert_floats_golden(out, " ".join(g["decoded_fp32"].split()[:m]), "ring decode fp32")
    out = C._ring_decode_final(payload, torch.empty(m, dtype=torch.bfloat16), "int8", B)
    assert_floats_golden(out, " ".join(g["decoded_bf16"].split()[:m]), "ring decode bf16")
    assert "ff800000" in g["decoded_fp32"].split()[6 * B : 7 * B]
    payload, finite = C._ring_encode_final(x[: 7 * B].contiguous(), "float32", "int8", B)
    assert not finite  # the owner flags the overflow before anyone writes
    assert payload == int8_payload_by_hand(" ".join(g["scales"].split()[:7]), g["q"][: 2 * 7 * B])
    # half inputs are quantized from their own dtype, as the codec does
    for dtype in (torch.bfloat16, torch.float16):
        h = GOLDEN[str(dtype).removeprefix("torch.")]
        payload, finite = C._ring_encode_input(f16(h["x"], dtype), "int8", B)
        assert finite and payload == int8_payload_by_hand(h["scales"], h["q"]), dtype


@needs_ext
def test_ring_exact_payload_layout():
    """codec "none": reduce-scatter payloads are fp32 (half types widened), the all-gather's the dtype."""
    C = _extension.require()
    x = f32(GOLDEN["fp32"]["x"])[: 7 * B].contiguous()
    payload, finite = C._ring_encode_input(x, "none", 256)
    assert finite and payload == b"".join(struct.pack("<I", u) for u in _words(hex_of(x)))
    for dtype in (torch.bfloat16, torch.float16):
        h = f16(GOLDEN[str(dtype).removeprefix("torch.")]["x"], dtype)
        payload, finite = C._ring_encode_input(h, "none", 256)
        assert finite and payload == b"".join(struct.pack("<I", u) for u in _words(hex_of(h.float())))
        payload, finite = C._ring_encode_final(h.float(), str(dtype).removeprefix("torch."), "none", 256)
        assert finite and payload == b"".join(struct.pack("<H", u) for u in _words(hex_of(h)))


# ---------------------------------------------------------------------------
# printed by `python tools/golden_vectors.py` (do not edit by hand; see the module docstring)

GOLDEN = {
    'block_size': 32,
    'fp32': {
        'x': (
            '417e0000 c17e0000 417e0000 3d800000 bd800000 3e400000 be400000 3ea00000 bea00000 3ee00000 '
            '417b0000 c17d0000 417d0000 c17b0000 40fe0000 c1010000 00000000 80000000 bd800000 3ea00000 '
            'c1470000 40040000 40b20000 40c20000 c1350000 c04c0000 3f880000 3fe80000 414b0000 414d0000 '
            '41770000 3ee00000 bed69425 3f66b7c4 be2cad72 bf371fe6 3e2ff23f 3f800000 be26c97e bee08a58 '
            '3e6a2c58 bf0098c8 3e862f2b bf22cb55 bd60c34d be9bc95e bf26c822 3d4cceee 3f748463 bf800000 '
            'bf1c78bb bf0078e8 be0d98b9 3c5164a3 bd42882b bf261482 be8e6f25 3dec22da 3f784086 3e926be7 '
            '3e8d7aa2 be7e185d 3e84eecd beec6e02 c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd '
            'c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd '
            'c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd '
            'c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd 80000000 00000000 00000000 80000000 '
            '00000000 00000000 80000000 00000000 00000000 80000000 00000000 00000000 80000000 00000000 '
            '00000000 80000000 00000000 00000000 80000000 00000000 00000000 80000000 00000000 00000000 '
            '80000000 00000000 00000000 80000000 00000000 00000000 80000000 00000000 00000035 8000000e '
            '00000021 00000028 0000003c 8000001e 80000016 00000007 0000000f 00000009 8000002a 00000019 '
            '0000000f 0000003a 00000036 80000009 80000030 80000016 80000009 00000032 00000035 80000013 '
            '00000027 00000039 00000036 80000012 8000001a 8000001c 8000002e 0000000b 00000022 80000037 '
            '039c1e9e 83821c9e 0330c3bf 0367c8a8 82a50851 01cc785d 835645cd 01faf37d 03a990f5 836d9c33 '
            '03783a78 02900f6e 83823914 032c038e 83397fa7 02887a94 832ae2cb 036f179a 831007e4 017ba74a '
            '032f8a28 83993560 039f87e0 8290c7a9 0365f5a4 023513a0 03527619 02f7b1ae 8311733a 027af75d '
            '02d5c2cd 03aa2425 ff09808b fe8ff8c4 7ef78d04 ff50e9ec ff2fa31c fe8965c4 7f1e7891 7f36c518 '
            'fd96575c 7e3b0d79 ff4d555a febfd664 7f197983 ff326d88 ff405079 ff0d3802 7f5eee6e fe63be5e '
            'fe8c4e74 ff164c5d 7f2af2e1 ff3b90ac 7f32f2ff fe00f4af ff481006 7f24e819 ff4b5d67 7d52823f '
            'ff39730d ff211351 ff38201c ff7fffff bede8c03 3f50afc7 3d5f1983 3ceb1128 bf7bc8ce bf38b7f2 '
            'bf1b69e6 bf03b6aa 3ea2bf23 bdc9b0ea bf770450 7fc00000 3da2571d 3e9ef439 3f073536 bf3842f1 '
            '3f59a350 bf495b72 3ecf2036 3ce36b04 bd4f3b29 bf2fc006 3f2552bb 3ee4e5ee 3f115bea be360fe3 '
            '3f7501ce be0d7531 bf2ec1f9 3f17c2b6 bf23e5f3 3e922725 bedf31b9 bf3346a0 bd5b6f4a bec6e403 '
            'be4e1216 3ea37eeb 7f800000'
        ),
        'scales': '3e000000 3c010204 3ceeaa21 00000000 00000000 0055bd8e 7c010204 7fc00000 7fc00000',
        'q': (
            '7f817f000002fe02fe047e827e8240c0000000029c102c30a6e6080e66667c04cb72eba5167febc81dc021aff9d9ad06'
            '7981b2c0ee02faaedd0f7b2423e021c58181818181818181818181818181818181818181818181818181818181818181'
            '000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000'
            '00000000000000000000000000000000759f4257e10ab00c7fa75d1b9f40bb19c059ca06428e77e556114f2eca17287f'
            'bcdc3d98a9de4f5bf7179ad04ca7a1ba6fe4ddb555a359f09d529b07a4b0a58100000000000000000000000000000000'
            '0000000000000000000000000000000000000000000000'
        ),
        'decoded_fp32': (
            '417e0000 c17e0000 417e0000 00000000 00000000 3e800000 be800000 3e800000 be800000 3f000000 '
            '417c0000 c17c0000 417c0000 c17c0000 41000000 c1000000 00000000 00000000 00000000 3e800000 '
            'c1480000 40000000 40b00000 40c00000 c1340000 c0500000 3f800000 3fe00000 414c0000 414c0000 '
            '41780000 3f000000 bed5ab57 3f65cb97 be2952a5 bf376ede 3e3162c6 3f800000 be2952a5 bee1c387 '
            '3e69d3a7 bf010204 3e850a14 bf23468d bd61c387 be9d3a75 bf274e9d 3d418306 3f73e7d0 bf800000 '
            'bf1d3a75 bf010204 be112244 3c810204 bd418306 bf254a95 be8d1a34 3df1e3c8 3f77efe0 3e912244 '
            '3e8d1a34 be810204 3e850a14 beeddbb7 c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd '
            'c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd '
            'c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd '
            'c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd 00000000 00000000 00000000 00000000 '
            '00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 '
            '00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 '
            '00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 '
            '00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 '
            '00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 '
            '00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 '
            '039cbe88 8381f34b 0330d6f5 03691b5a 82a61f43 01d659e3 835659e3 02009c55 03aa2426 836e7733 '
            '03792ee5 0290afe0 8381f34b 032b7b1c 8338e0ba 0285f82e 832b7b1c 036e7733 8310afe0 01809c55 '
            '0330d6f5 8398b9a5 039f6c74 8290afe0 03666d6e 023632ce 0353abf7 02f680f8 8310afe0 027680f8 '
            '02d659e3 03aa2426 ff091224 fe912244 7ef5ebd8 ff51a346 ff2f5ebd fe891224 7f1f3e7d 7f376ede '
            'fd912244 7e3972e6 ff4d9b36 fec18306 7f193265 ff3366ce ff3f7efe ff0d1a34 7f5fbf7f fe61c387 '
            'fe8d1a34 ff172e5d 7f2b56ad ff3b76ee 7f3366ce fe010204 ff478f1e 7f254a95 ff4b972e 7d61c387 '
            'ff3972e6 ff214285 ff376ede ff800000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 '
            '7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 '
            '7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 '
            '7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 '
            '7fc00000 7fc00000 7fc00000'
        ),
        'decoded_bf16': (
            '417e c17e 417e 0000 0000 3e80 be80 3e80 be80 3f00 417c c17c 417c c17c 4100 c100 0000 0000 '
            '0000 3e80 c148 4000 40b0 40c0 c134 c050 3f80 3fe0 414c 414c 4178 3f00 bed6 3f66 be29 bf37 '
            '3e31 3f80 be29 bee2 3e6a bf01 3e85 bf23 bd62 be9d bf27 3d42 3f74 bf80 bf1d bf01 be11 3c81 '
            'bd42 bf25 be8d 3df2 3f78 3e91 3e8d be81 3e85 beee c06d c06d c06d c06d c06d c06d c06d c06d '
            'c06d c06d c06d c06d c06d c06d c06d c06d c06d c06d c06d c06d c06d c06d c06d c06d c06d c06d '
            'c06d c06d c06d c06d c06d c06d 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 '
            '0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 '
            '0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 '
            '0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 039d 8382 '
            '0331 0369 82a6 01d6 8356 0201 03aa 836e 0379 0291 8382 032b 8339 0286 832b 036e 8311 0181 '
            '0331 8399 039f 8291 0366 0236 0354 02f7 8311 0277 02d6 03aa ff09 fe91 7ef6 ff52 ff2f fe89 '
            '7f1f 7f37 fd91 7e39 ff4e fec2 7f19 ff33 ff3f ff0d 7f60 fe62 fe8d ff17 7f2b ff3b 7f33 fe01 '
            'ff48 7f25 ff4c 7d62 ff39 ff21 ff37 ff80 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 '
            '7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 '
            '7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0'
        ),
        'decoded_fp16': (
            '4bf0 cbf0 4bf0 0000 0000 3400 b400 3400 b400 3800 4be0 cbe0 4be0 cbe0 4800 c800 0000 0000 '
            '0000 3400 ca40 4000 4580 4600 c9a0 c280 3c00 3f00 4a60 4a60 4bc0 3800 b6ad 3b2e b14b b9bb '
            '318b 3c00 b14b b70e 334f b808 3428 b91a ab0e b4ea b93a 2a0c 3b9f bc00 b8ea b808 b089 2408 '
            'aa0c b92a b469 2f8f 3bbf 3489 3469 b408 3428 b76f c366 c366 c366 c366 c366 c366 c366 c366 '
            'c366 c366 c366 c366 c366 c366 c366 c366 c366 c366 c366 c366 c366 c366 c366 c366 c366 c366 '
            'c366 c366 c366 c366 c366 c366 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 '
            '0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 '
            '0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 '
            '0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 8000 '
            '0000 0000 8000 0000 8000 0000 0000 8000 0000 0000 8000 0000 8000 0000 8000 0000 8000 0000 '
            '0000 8000 0000 8000 0000 0000 0000 0000 8000 0000 0000 0000 fc00 fc00 7c00 fc00 fc00 fc00 '
            '7c00 7c00 fc00 7c00 fc00 fc00 7c00 fc00 fc00 fc00 7c00 fc00 fc00 fc00 7c00 fc00 7c00 fc00 '
            'fc00 7c00 fc00 7c00 fc00 fc00 fc00 fc00 7e00 7e00 7e00 7e00 7e00 7e00 7e00 7e00 7e00 7e00 '
            '7e00 7e00 7e00 7e00 7e00 7e00 7e00 7e00 7e00 7e00 7e00 7e00 7e00 7e00 7e00 7e00 7e00 7e00 '
            '7e00 7e00 7e00 7e00 7e00 7e00 7e00 7e00 7e00 7e00 7e00'
        ),
        'acc': (
            '4058d9ed bf8f8ea3 c05c8c4c 3ff0d340 c00b7ebd bdab9c60 3f23c0f4 bfe0d00d 3f9facbc c056edb4 '
            '3f8171b4 406b565a c0269eb9 c04bf093 bec32040 3ffcfe00 c00104ac 402423fe 3f802372 407ef735 '
            'c0568710 401e31ab 40293e9c bf1ccd0e be32f7e9 3f343b18 c00d8c07 c056825b 400bc47b 406b648b '
            '3fbe2137 3fc15e4e 3d85afd0 c01667ff bbbf7678 bf75c014 407aab25 c0437c62 c07aee91 bf843e4e '
            'be212632 c04f65dc bf4718c8 c011bea9 3f0e5758 bf97200e 3e90eed6 be91753d 403035bd 407fd243 '
            '40346a21 bfefead2 c04ff9f8 401e2cf9 c06576fe bfb22578 3ff7ed5e c00ea8c9 3fa4b4b1 c05028b3 '
            '4065c686 c0694f10 c05cbe50 bfb214cb 3f2a9726 4015feee 405adc06 c03544ec 40640918 bfae3818 '
            '3fa90402 3f9a9b22 bf2a88ea c028a9fc 405a9ced 3e978867 be628401 40736a56 c02f3b13 3fa39fa0 '
            '3ecd68b4 405b9f21 bff3199a 4047fb52 40283fca 3fe5d428 c01d5abd c03aaf3f bf2a21e1 40155cb1 '
            '3f0cd622 bff42797 3ffab52a bf086982 4033fe08 bf38494b c01f0fc7 c059c564 c03b11a5 bf6b3916 '
            'c0399a39 c07a4c27 3fb40e89 c0189e35 400a81b1 4066105b 40320c46 401afe86 401c4c57 40667795 '
            'bfd94404 400ccd16 404b6d40 3ec583c0 3f16fa5c 3ed9e40c bf1a68e0 40316a4b 3fb4985a bf9e425a '
            '3ff86742 bf7794d4 403974e3 c04d50ef bec72991 bf51018b 4009e056 c0085705 3f73a199 3e575375 '
            'be6c161e 3f6a9906 3fb2412d 3f2a1112 3fb0ab6d 3f9078c4 c018e55c bf1f2dfd c0637337 4064bc92 '
            'c06f17fd c075f35a 405c17d6 3fb512e8 bfa61e13 3f974da0 bfac4244 40072737 3fd38c5e bff4104b '
            'bf909e8c 3fa03147 c05c57ef bdb35d3f 3f8f5d14 4068ff80 407c91dd 405ce53c 406fd203 40617a33 '
            '406f42ce 3f1c67f8 c046c245 407eb4ec c06c7875 c050994d c010b73f 3e188fde 40629be6 4043d66a '
            'bfd27b63 4073e4e3 405d0e56 bfbb3a14 3de57ec2 402ac100 3fe63ab7 bf8542e8 bf97e8c3 bfee7ed7 '
            '3f830825 bf435565 3ee2c336 c028cd04 406b5aff 40184199 400fab12 be5328f2 bf944ce8 bf3270d1 '
            '3f0bce7b bff0f733 3fea3aeb 3f54cb49 be65cfa9 c012bd0d bf43b715 3fd89525 c057e223 4068a7e9 '
            '3fb7891a 4071472c c02f56cd c04414fe 3fd4fed4 4016866c 405250ff 40038943 3fca77f1 3fc5f243 '
            '3faeca96 c0472cff 4048df4c bfdfbcc5 bfece932 3ec008b2 40543eea 3fbddd23 3f828678 bff9b633 '
            '4040b730 3ffcf266 c0410c89 4068844f 3f898f02 bfb9074f bf97955b c05cbcd5 bfb8424f c0091a1e '
            '3f6ff069 403ae11f c03a0788 3fae267c c01fe19e c05de5e0 bfe1d8ce 406e55d8 3ffabf66 c0460c9d '
            '3f8d0859 4046ab5a bed1717d 3fa23ee9 404e9ee9 3e89ee38 bf646914 403bc52c c0734266 c06c4f7b '
            '3ff25143 c01b78ec c06d091b 4010966d 40187b4b bbeedc48 404d90bf c052125f bf5e9a99 3fcbca73 '
            'c00dadb3 c0104a13 bf9eddfa'
        ),
        'acc_plus_decoded': (
            '419a1b3e c187f8ea 4146dced 3ff0d340 c00b7ebd 3e2a31d0 3ec781e8 bfc0d00d 3f7f5978 c036edb4 '
            '4186171b c1412a6a 41525852 c1977e12 40f3cdfc c0c0c080 c00104ac 402423fe 3f802372 40877b9a '
            'c17da1c4 408f18d6 41024fa7 40ac665e c136cbe0 c022f13a bf9b180e bfcd04b6 416ef11f 41836c91 '
            '4187e213 4000af27 beb43f63 bfb9ea32 be2f4e59 bfd69779 4082e0a9 c0037c62 c082c1de bfbcaf30 '
            '3d915aea c06fa65d bf0493be c03a904c 3f003b20 bfbe6eab bebdae64 be7289b8 406d2fb1 403fd243 '
            '400d1b84 c01835ea c0590c1c 401f2efd c0687d0a c0026561 3fd4a6d1 c00719ab 40105650 c03e046a '
            '407769cc c0796f50 c04c1d0e bfed8bb9 c0422704 bfad9bbe be8f8638 c0d108dc be0c3b50 c0a1f46c '
            'c0184acc c01f7f3c c08bb784 c0cabb64 be917f00 c059dbc0 c07af50d 3dd3b120 c0ce03f0 c01afcfd '
            'c0531fb6 be896d60 c0b32ccd bf1345ec bf891a06 bff3c572 c0c513c5 c0d3be06 c08baaa3 bfaee038 '
            'c0499744 c0b3704c bfdee470 c0877397 bf633b14 c08d6f90 c01f0fc7 c059c564 c03b11a5 bf6b3916 '
            'c0399a39 c07a4c27 3fb40e89 c0189e35 400a81b1 4066105b 40320c46 401afe86 401c4c57 40667795 '
            'bfd94404 400ccd16 404b6d40 3ec583c0 3f16fa5c 3ed9e40c bf1a68e0 40316a4b 3fb4985a bf9e425a '
            '3ff86742 bf7794d4 403974e3 c04d50ef bec72991 bf51018b 4009e056 c0085705 3f73a199 3e575375 '
            'be6c161e 3f6a9906 3fb2412d 3f2a1112 3fb0ab6d 3f9078c4 c018e55c bf1f2dfd c0637337 4064bc92 '
            'c06f17fd c075f35a 405c17d6 3fb512e8 bfa61e13 3f974da0 bfac4244 40072737 3fd38c5e bff4104b '
            'bf909e8c 3fa03147 c05c57ef bdb35d3f 3f8f5d14 4068ff80 407c91dd 405ce53c 406fd203 40617a33 '
            '406f42ce 3f1c67f8 c046c245 407eb4ec c06c7875 c050994d c010b73f 3e188fde 40629be6 4043d66a '
            'bfd27b63 4073e4e3 405d0e56 bfbb3a14 3de57ec2 402ac100 3fe63ab7 bf8542e8 bf97e8c3 bfee7ed7 '
            '3f830825 bf435565 3ee2c336 c028cd04 406b5aff 40184199 400fab12 be5328f2 bf944ce8 bf3270d1 '
            '3f0bce7b bff0f733 ff091224 fe912244 7ef5ebd8 ff51a346 ff2f5ebd fe891224 7f1f3e7d 7f376ede '
            'fd912244 7e3972e6 ff4d9b36 fec18306 7f193265 ff3366ce ff3f7efe ff0d1a34 7f5fbf7f fe61c387 '
            'fe8d1a34 ff172e5d 7f2b56ad ff3b76ee 7f3366ce fe010204 ff478f1e 7f254a95 ff4b972e 7d61c387 '
            'ff3972e6 ff214285 ff376ede ff800000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 '
            '7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 '
            '7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 '
            '7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 '
            '7fc00000 7fc00000 7fc00000'
        ),
    },
    'bfloat16': {
        'x': (
            '43fe c3fe 43a9 c2f4 c160 c228 4238 40c0 c3f3 436e c34a c32a c381 4336 43e5 c346 43eb 43c3 '
            '4306 c38f c34a c294 434e 43c9 43c1 c3f7 43bb c399 4346 43d3 c3f7 432e c003 3f25 bfd5 4028 '
            'bf54 403b bff3 3ff0 c03f c027 bfdd bfdc bec5 be4c 3f39 bfcf c020 bfb5 4005 4027 bf51 c019 '
            '3ed6 c02e c00f 3ee8 bfa0 3f40 bd3f 3f70 bf81 bfa1 bb87 bb0a babb 3c13 3b77'
        ),
        'scales': '40800000 3cc08102 38942851',
        'q': (
            '7f8154e2fcf60c02863cced6c02e72ce766222b8ceee346460845eb4326a842ca91bb970dd7caf508191b7b7f0f81fbb'
            '96c4586fdd9a128ca113cb20fe28d5cac6e2ec7f35'
        ),
    },
    'float16': {
        'x': (
            '5ff0 dff0 5bd0 d4e0 50c0 5cc8 d810 de58 dc98 5b50 df28 5c48 d950 4c80 5ed8 d5e0 d9b0 d520 '
            '5cd8 59b0 4600 deb8 da10 5040 5c78 52c0 5760 5760 5c78 5c38 56a0 dc58 3e0f b7ff bbab 3c95 '
            '41bc 3d55 bb0e 3e53 3dd9 3fbc c1ef bb0a b658 3803 bf77 409f 418f 418c 32f2 bd9c c04f bb99 '
            'b89b be8e 4132 bdc1 4105 344d c16c 4199 4128 41bf 9e50 1de3 9e5d 1fd6 1511'
        ),
        'scales': '40800000 3cbf5ebd 387cb973',
        'q': (
            '7f813eec0a4ce09ab63a8e44d6046ee8d2ec4e2e0294d008480e1e1e48441aba41ebd7317b39da443f5381daef15b063'
            '777709c4a4d7e7ba6fc26b0c8c786e7b9a5f997f15'
        ),
    },
    'stochastic': {
        'x': (
            '417e0000 c17e0000 417e0000 3d800000 bd800000 3e400000 be400000 3ea00000 bea00000 3ee00000 '
            '417b0000 c17d0000 417d0000 c17b0000 40fe0000 c1010000 00000000 80000000 bd800000 3ea00000 '
            'c1470000 40040000 40b20000 40c20000 c1350000 c04c0000 3f880000 3fe80000 414b0000 414d0000 '
            '41770000 3ee00000 bed69425 3f66b7c4 be2cad72 bf371fe6 3e2ff23f 3f800000 be26c97e bee08a58 '
            '3e6a2c58 bf0098c8 3e862f2b bf22cb55 bd60c34d be9bc95e bf26c822 3d4cceee 3f748463 bf800000 '
            'bf1c78bb bf0078e8 be0d98b9 3c5164a3 bd42882b bf261482 be8e6f25 3dec22da 3f784086 3e926be7 '
            '3e8d7aa2 be7e185d 3e84eecd beec6e02 c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd '
            'c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd '
            'c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd '
            'c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd bfb2d5b2 bfe71157 3ea3cbcd bfdc4d6d '
            'bf8b2c81 3f9cd7d1 3ea139e1 bf4d9001 bf60ffa2 3ff1b19d 3fb313ad bfa50424 bf9e9c45 3f88097d '
            '3fa9ca36 bf1b1dda 3eabd686 3d6ca1be 3f43a39e bfa40162 bdc19274 bf7d3867 3fe1546c bfde691c '
            'bf101935 bffef3fa bfafdac6 bf186629 bfdc3dd5 3eb77db6 bfa17190 bf7134e6'
        ),
        'scales': '3e000000 3c010204 3ceeaa21 3c807af3',
        'q': {
            '0@0': (
                '7f817f000001fe02fe047e827e833fc00000ff039d102c31a5e6090e65667b04cb73eaa5167febc91dc022aff9d9ad06'
                '7981b2c0ee01faaedd0f7b2423e121c68181818181818181818181818181818181818181818181818181818181818181'
                'a78c1492ba4e14ccc87859aeb14455da160330affac17091dc81a8da9217afc4'
            ),
            '0@4294967232': (
                '7f817f000002fe03fe047e817f833fbf000000039d102c31a6e6090e65667b03cb72eba5167febc91dc021aff9daad06'
                '7a81b2c0ee02faaedd0f7b2423e121c58181818181818181818181818181818181818181818181818181818181818181'
                'a78d1492bb4e15cdc87959aeb14455d9150331affac17091dd81a9da9217afc4'
            ),
            '0@1103806595040': (
                '7f817f010001fe02fe047d817e8340bf000000029d112d31a5e7090e65677c04cb72eba5167febc81dc021affad9ae06'
                '7981b3c1ef02faaedd0f7b2423e021c58181818181818181818181818181818181818181818181818181818181818181'
                'a78d1592bb4e14cdc87959adb14454d9150430affac17091dc81a9db9317b0c4'
            ),
            '0@9223372036854775680': (
                '7f817f00ff02fe03fe037e817e8240bf000000029d112c30a6e7080f65677b03cb73eaa6167febc81dc021b0f9d9ad07'
                '7a81b2c0ef02faaddc0f7c2423e121c58181818181818181818181818181818181818181818181818181818181818181'
                'a78d1492bb4e14cdc87859aeb14355d9150331affac17091dc81a8da9217b0c4'
            ),
            '2654435769@0': (
                '7f817f00ff02fe02fe047e827e823fc00000ff029c102c31a6e7080f65667c04cb72eba6157febc81dc021aff9d9ad06'
                '7981b2c1ef01faaedc0f7b2523e021c58181818181818181818181818181818181818181818181818181818181818181'
                'a78d1492ba4e14cdc87859aeb14455da150430affac17091dd81a9da9217afc4'
            ),
            '2654435769@4294967232': (
                '7f817f01ff01ff03fe037e827e8240bf0000ff029c102d30a5e6080e66667c03cb72eba5167febc81dc022aff9d9ad06'
                '7981b3c0ee02faaddd0f7b2423e021c68181818181818181818181818181818181818181818181818181818181818181'
                'a78d1593bb4e14cdc87859adb14454d9150431aefac17092dd81a8da9317b0c4'
            ),
            '2654435769@1103806595040': (
                '7f817f010002fe03fd037d817f8340c00000ff029d102c30a5e6090f66667c04ca72eba5167febc81dc021b0f9daad06'
                '7981b3c1ee02faaedd0e7b2523e121c58181818181818181818181818181818181818181818181818181818181818181'
                'a78d1592bb4e14cdc87859aeb14455d9150431aefac17091dc81a8da9317b0c4'
            ),
            '2654435769@9223372036854775680': (
                '7f817f00ff01fe02fe037d827f823fc00000ff029d112c31a6e7080e65667c03cb72eaa5167febc81dc021aff9d9ad06'
                '7a81b3c1ee01faaedd0f7b2523e021c58181818181818181818181818181818181818181818181818181818181818181'
                'a78d1592ba4e14ccc87959aeb14455da150331aefac17192dc81a9da9217afc4'
            ),
            '4294967295@0': (
                '7f817f010001ff03fe047e827e8240bf0000ff039d102d30a5e6080f65667b04cb73eba5167febc81dc121aff9daad06'
                '7981b2c1ee01faaddd0f7b2423e121c68181818181818181818181818181818181818181818181818181818181818181'
                'a78d1592bb4e14cdc87859aeb14455d9150431aefac17191dc81a8da9217b0c4'
            ),
            '4294967295@4294967232': (
                '7f817f000001fe02fe047e817e8240c00000ff029c102c30a6e6090f65677b03cb72eba5167febc81dc022aff9daad07'
                '7a81b3c0ef02faaedd0f7c2423e021c68181818181818181818181818181818181818181818181818181818181818181'
                'a78d1492bb4e14cdc8795aaeb14455d9150431aefac17091dc81a9da9217afc4'
            ),
            '4294967295@1103806595040': (
                '7f817f000001fe02fd037d827f823fc0000000029c102d31a5e6080e66667c04cb72eaa5157febc91ec021b0f9d9ad06'
                '7981b3c0ef02faaedd0f7b2423e121c58181818181818181818181818181818181818181818181818181818181818181'
                'a78c1493ba4e14cdc8785aaeb14454da160431aefac17092dc81a9da9217b0c3'
            ),
            '4294967295@9223372036854775680': (
                '7f817f010002fe02fd047e827e8240c0000000039d112d30a6e6090e65667b03cb73eba5167fecc81dc022b0f9daae06'
                '7981b3c1ee02faaedc0f7b2423e021c68181818181818181818181818181818181818181818181818181818181818181'
                'a78d1492ba4e14ccc87859aeb14354d9160430aefac17191dc81a8da9217afc4'
            ),
        },
    },
    'hash': {
        '0@0': '351768fe',
        '0@1': '543932b7',
        '1@0': '4723c390',
        '2654435769@12345': 'c064deba',
        '4294967295@4294967295': '18de1ac1',
        '4294967295@4294967296': 'ed5c181a',
        '7@4294967301': '45544031',
        '7@8589934597': '0760291c',
        '123456789@1099511627853': '50c96982',
        '2147483648@4611686018427387907': '518d523e',
        '42@9223372036854775807': 'd8121684',
        '0@6822318947648335885': '98c1fd61',
    },
}
