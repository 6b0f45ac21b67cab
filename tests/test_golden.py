"""Golden vectors of the block codecs (int8 and fp4): every backend against committed hex.

The other codec tests compare each backend with the torch reference in prime/ops.py;
if the reference and a backend drifted together (an edit to both), they would still
pass. These vectors are fixed: they were printed by tools/golden_vectors.py, a second
reading of docs/wire-format.md in plain Python (no torch, nothing from prime), and
committed below as hex (GOLDEN). Every backend available here must reproduce them
bit for bit: the torch reference, the C++ CPU op and each CPU instruction set, Triton
(under TRITON_INTERPRET=1 in a subprocess on a CPU machine), CUDA and Triton on a GPU.

A few entries, derived by hand from the format (block size B = 32):

- Block 0 has max |x| = 15.875 = 127 * 2^-3 (three times, both signs), so
  15.875 / 127.5 = 0.1245 rounds up to the grid value 2^-3 (scale 0.125, bits 3e000000) and
  inv = 1 / 0.125 = 8 exactly;
  x = (k + 0.5) / 8 gives v = k + 0.5, a tie, rounded to even:
  0.5 -> 0, -0.5 -> 0, 1.5 -> 2, -1.5 -> -2 (fe), 2.5 -> 2, -2.5 -> -2, 3.5 -> 4,
  125.5 -> 126 (7e), -126.5 -> -126 (82); the maxima give 127 (7f) and -127 (81),
  never -128; x = -0.0 gives 0.
- Block 1 has max |x| = 1 (both signs): 1 / 127.5 = 1.0039 * 2^-7 rounds up to the
  grid value G[1] * 2^-7 = 2^(1/18 - 7) (3c050672, 0.0081192); inv = 1 / that = 123.16,
  so the maxima give 123 (7b) and -123 (85): a / scale lies in (122.68, 127.5], so the
  clamp never cuts more than a tie at 127.5.
- Block 2 holds 32 copies of fp32(-3.7): 3.7 / 127.5 = 1.857 * 2^-6 rounds up to
  G[17] * 2^-6 (3cf6544d), and every q is -123 (85).
- Block 3 holds only zeros (some -0.0): a = 0, scale = 0, inv = 0, q = 0.
- Block 4 holds subnormals below 60 * 2^-149: a / 127.5 is below half the smallest
  subnormal and rounds to 0, so the scale is 0, inv = 0 and q = 0.
- Block 5 (a ~ 1e-36): a / 127.5 is subnormal, so the scale is 2^-126 (00800000), the
  grid's smallest.
- Block 6 holds -FLT_MAX: FLT_MAX / 127.5 rounds up to 7c050672, and -FLT_MAX decodes
  to ff7fa863: finite in fp32, but -inf in bf16 (ff80), which the ring's owner flags as
  an overflow.
- Block 7 holds a NaN and block 8 (7 values, the short last block) an infinity:
  scale 7fc00000 (the canonical quiet NaN, the flag) and q all 0.
- Stochastic rounding rounds a / 127 up to the grid instead (GOLDEN["stochastic"]
  ["scales"]: block 1's is 3c050672 as well, so x = +-1 gives v = +-123.16).
- Stochastic rounding at element index i = 2^32 keys its generator by
  lo = 0 and hi = 1: k = fmix32(seed ^ fmix32(1 ^ 0x9e3779b9)); the vectors at
  first_index 2^32 - 64 cross that boundary after two blocks.

fp4 (GOLDEN["fp4"], the same block size):

- Block 0 has max |x| = 1.5 = 6 * 2^-2 (both signs), so scale = 0.25 (3e800000) and
  inv = 4 exactly; x = t / 4 lands on v = t. The maxima give codes 7 and f (+-6). The
  seven midpoints go to the even magnitude index: 0.25 -> 0, 0.75 -> 1.0 (2),
  1.25 -> 1.0 (2), 1.75 -> 2 (4), 2.5 -> 2 (4), 3.5 -> 4 (6), 5 -> 4 (6), and the same
  with the sign bit (-0.25 -> 0: no -0); one ulp below or above a midpoint goes to the
  nearer neighbour; -0.1 / 4 and -0.0 give code 0. The packed bytes start f7 20 42 64:
  the first value is the low nibble.
- Block 2 (32 copies of -3.7): every code is f, so every byte ff.
- Block 8 holds 7 values: the last byte's high nibble is 0.
- "all_codes" decodes every byte value 00..ff (code 8, -0, included) under scales that
  decode to zero, subnormals, infinities and NaN.

Run `python tools/golden_vectors.py` to print the literal again; the last tests check
that it still prints exactly GOLDEN, and that the ring's int8 and fp4 payloads are laid
out as docs/wire-format.md says: int8 a 2-byte header K (the largest grid index k = 18 e + j
of its scales, little-endian), ceil(len/B) bytes K - k (254 for a zero scale or one more
than 253 steps below K, which therefore decodes as zeros; 255 for the flag), then the len
int8 values; fp4 ceil(len/B) little-endian fp32 scales, then the ceil(len/2) bytes of codes.
"""

from __future__ import annotations

import importlib.util
import os
import re
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


def q8(text: str, dtype: torch.dtype = torch.int8) -> torch.Tensor:
    """Bytes from hex: int8 values, or (dtype uint8) packed fp4 codes."""
    return torch.frombuffer(bytearray(bytes.fromhex(text)), dtype=dtype).clone()


def hex_of(t: torch.Tensor) -> str:
    """The golden spelling of a tensor: fp32 / 16-bit words, or q bytes."""
    t = t.detach().cpu().contiguous()
    if t.dtype in (torch.int8, torch.uint8):
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
    """One way to run a codec: a public backend on a device, or a named CPU instruction set."""

    def __init__(self, name: str, device: str, backend: str | None = None, isa: str | None = None):
        self.name, self.device, self.backend, self.isa = name, torch.device(device), backend, isa

    def _op(self, verb: str, codec: str):
        """The implementation of `verb` (quantize, dequantize, dequantize_add) for `codec` here."""
        if self.isa:
            op = getattr(torch.ops.prime, f"_{verb}_{codec}_isa{'_' if verb == 'dequantize_add' else ''}")
            return lambda *args: op(*args, self.isa)
        if self.backend == "torch":
            return getattr(ops, f"{verb}_{codec}_reference{'_' if verb == 'dequantize_add' else ''}")
        op = getattr(ops, f"{verb}_{codec}{'_' if verb == 'dequantize_add' else ''}")
        if verb == "quantize":
            return lambda x, block, seed: op(x, block, seed=seed, backend=self.backend, check_finite=False)
        return lambda *args: op(*args, backend=self.backend)

    def quantize(self, x, seed=None, codec="int8"):
        return self._op("quantize", codec)(x.to(self.device), B, seed)

    def dequantize(self, q, s, n, dtype, codec="int8"):
        q, s = q.to(self.device), s.to(self.device)
        return self._op("dequantize", codec)(*((q, s) if codec == "int8" else (q, s, n)), B, dtype)

    def dequantize_add_(self, acc, q, s, codec="int8"):
        acc = acc.to(self.device)
        self._op("dequantize_add", codec)(acc, q.to(self.device), s.to(self.device), B)
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


CODECS = ["int8", "fp4"]


def golden(codec: str) -> dict:
    """The vectors of one codec (int8's are GOLDEN's top level, fp4's GOLDEN["fp4"])."""
    return GOLDEN if codec == "int8" else GOLDEN["fp4"]


def codes_of(text: str, codec: str) -> torch.Tensor:
    return q8(text, torch.int8 if codec == "int8" else torch.uint8)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("impl", IMPLS)
def test_quantize_matches_golden(impl, codec):
    g = golden(codec)["fp32"]
    q, s = impl.quantize(f32(g["x"]), codec=codec)
    assert_hex_equal(hex_of(s), g["scales"], f"{impl} {codec} scales")
    assert_hex_equal(hex_of(q), g["q"], f"{impl} {codec} q")


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("impl", IMPLS)
def test_quantize_half_inputs_match_golden(impl, dtype, codec):
    g = golden(codec)[str(dtype).removeprefix("torch.")]
    q, s = impl.quantize(f16(g["x"], dtype), codec=codec)
    assert_hex_equal(hex_of(s), g["scales"], f"{impl} {codec} {dtype} scales")
    assert_hex_equal(hex_of(q), g["q"], f"{impl} {codec} {dtype} q")


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("impl", IMPLS)
def test_decode_matches_golden(impl, codec):
    for key in ("fp32", "all_codes"):  # (all_codes: fp4's every byte value)
        g = golden(codec).get(key)
        if g is None:
            continue
        q, s = codes_of(g["q"], codec), f32(g["scales"])
        n = len(g["decoded_fp32"].split())
        for dtype, name in [(torch.float32, "decoded_fp32"), (torch.bfloat16, "decoded_bf16"),
                            (torch.float16, "decoded_fp16")]:
            assert_floats_golden(impl.dequantize(q, s, n, dtype, codec), g[name], f"{impl} {codec} {key} -> {dtype}")
    g = golden(codec)["fp32"]
    acc = impl.dequantize_add_(f32(g["acc"]), codes_of(g["q"], codec), f32(g["scales"]), codec)
    assert_floats_golden(acc, g["acc_plus_decoded"], f"{impl} {codec} dequantize_add")


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("impl", IMPLS)
def test_stochastic_rounding_matches_golden(impl, codec):
    g = golden(codec)["stochastic"]
    x = f32(g["x"])
    for key, want in g["q"].items():
        seed, first = (int(v) for v in key.split("@"))
        if first:
            continue  # a tensor starts at element 0; offsets: the tests below
        q, s = impl.quantize(x, seed, codec)
        assert_hex_equal(hex_of(s), g["scales"], f"{impl} {codec} seed {seed} scales")
        assert_hex_equal(hex_of(q), want, f"{impl} {codec} seed {seed} q")


# ---------------------------------------------------------------------------
# stochastic rounding at element indices up to 2^63 - 1


def test_hash_matches_golden():
    """The generator itself, as the reference computes it: u = (h >> 8) * 2^-24."""
    for key, h in GOLDEN["hash"].items():
        seed, index = (int(v) for v in key.split("@"))
        u = ops.stochastic_uniform_reference(seed, torch.tensor([index], dtype=torch.int64))
        assert u.item() == (int(h, 16) >> 8) * 2.0**-24, f"seed {seed} index {index}: u {u.item()!r}, golden h {h}"


def _offset_cases(codec: str = "int8"):
    g = golden(codec)["stochastic"]
    for key, want in g["q"].items():
        seed, first = (int(v) for v in key.split("@"))
        yield seed, first, want


@pytest.mark.parametrize("codec", CODECS)
def test_reference_at_high_indices_matches_golden(codec):
    x = f32(golden(codec)["stochastic"]["x"])
    quantize = getattr(ops, f"quantize_{codec}_reference")
    for seed, first, want in _offset_cases(codec):
        q, _ = quantize(x, B, seed, first_index=first)
        assert_hex_equal(hex_of(q), want, f"{codec} reference seed {seed} first_index {first}")


@needs_ext
@pytest.mark.parametrize("codec", CODECS)
def test_cpu_codec_at_high_indices_matches_golden(codec):
    """The C++ kernels with a global element offset (the ring's and the ops' code path)."""
    g = golden(codec)["stochastic"]
    x = f32(g["x"])
    for seed, first, want in _offset_cases(codec):
        q, s = _extension.require()._codec_quantize_at(x, B, seed, first, codec)
        assert_hex_equal(hex_of(s), g["scales"], f"C++ {codec} seed {seed} first_index {first}")
        assert_hex_equal(hex_of(q), want, f"C++ {codec} seed {seed} first_index {first}")


@pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU")
@pytest.mark.parametrize("codec", CODECS)
def test_gpu_backends_beyond_2_to_the_32_match_golden(codec):
    """CUDA and Triton keep no offset argument: a tensor of 2^32 + 64 fp32 values holds the
    golden input at element 2^32 - 64, so its blocks straddle index 2^32."""
    first = 2**32 - 2 * B
    g = golden(codec)["stochastic"]
    x_small = f32(g["x"])
    n = first + x_small.numel()
    need = n * 5 + (1 << 30)
    if torch.cuda.mem_get_info()[0] < need:
        pytest.skip(f"needs {need / 2**30:.0f} GiB of free GPU memory")
    x = torch.zeros(n, device="cuda")
    x[first:] = x_small.cuda()
    quantize = getattr(ops, f"quantize_{codec}")
    code_start = first if codec == "int8" else first // 2
    for backend in ops.available_backends("cuda"):
        if backend == "torch":
            continue
        for seed in (s for s, f, _ in _offset_cases(codec) if f == first):
            q, s = quantize(x, B, seed=seed, backend=backend, check_finite=False)
            assert_hex_equal(hex_of(q[code_start:]), g["q"][f"{seed}@{first}"], f"{backend} {codec} seed {seed}")
            assert_hex_equal(hex_of(s[first // B :]), g["scales"], f"{backend} {codec} seed {seed} scales")
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
    # pytest's closing line (a plugin may print warnings after it)
    summary = re.findall(r"^.*\d+ (?:passed|failed|errors?)\b.*$", out, re.M)[-1]
    assert "passed" in summary and "failed" not in summary, summary
    assert int(summary.split(" passed")[0].split()[-1]) >= 5, summary  # the four golden tests + bf16/fp16


# ---------------------------------------------------------------------------
# fp4


def _fp4_words(text: str, n: int) -> str:
    return " ".join(text.split()[:n])


def test_fp4_hand_derived_entries():
    """The fp4 entries derived by hand in this module's docstring."""
    g = GOLDEN["fp4"]["fp32"]
    scales = g["scales"].split()
    q = bytes.fromhex(g["q"])
    codes = [b >> (4 * k) & 15 for b in q for k in (0, 1)]
    assert scales[0] == "3e800000" and f32(scales[0]).item() == 0.25
    assert q[:4] == bytes.fromhex("f7204264")
    x0 = f32(g["x"])[:B].tolist()
    expected = {1.5: 7, -1.5: 15, 0.25 / 4: 0, 0.75 / 4: 2, 1.25 / 4: 2, 1.75 / 4: 4, 2.5 / 4: 4, 3.5 / 4: 6,
                5.0 / 4: 6, -0.25 / 4: 0, -0.75 / 4: 10, -1.25 / 4: 10, -1.75 / 4: 12, -2.5 / 4: 12, -3.5 / 4: 14,
                -5.0 / 4: 14}
    seen = set()
    for j, x in enumerate(x0):
        if x in expected:
            assert codes[j] == expected[x], (j, x, codes[j])
            seen.add(x)
    assert seen == set(expected)
    assert 8 not in codes  # -0 is never written
    assert q[2 * B // 2 : 3 * B // 2] == b"\xff" * (B // 2)  # all equal (-3.7): -6 everywhere
    assert scales[3] == "00000000" and not any(codes[3 * B : 4 * B])  # zeros
    assert scales[7] == "7fc00000" and not any(codes[7 * B : 8 * B])  # the flag
    n = len(f32(g["x"]))
    assert n == 8 * B + 7 and len(q) == (n + 1) // 2 and q[-1] >> 4 == 0  # odd count: high nibble 0


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
    # all equal (-3.7): 3.7 / 127.5 = 1.857 * 2^-6 rounds up to G[17] * 2^-6 (3cf6544d), v = -122.95
    assert scales[2] == "3cf6544d" and q[2 * B : 3 * B] == b"\x85" * B
    assert scales[3] == "00000000" and q[3 * B : 4 * B] == bytes(B)  # zeros
    # fp32(1 / 127.5) = 1.0039 * 2^-7 rounds up to G[1] * 2^-7 = 2^(1/18 - 7): 3f850672 - (7 << 23)
    assert scales[1] == "3c050672"
    assert GOLDEN["stochastic"]["scales"].split()[1] == "3c050672"  # 1 / 127 = 1.0079 * 2^-7: the same
    assert q[B + 5] == 123 and q[B + 17] == 256 - 123  # x = +-1: v = +-1 / 0.0081192... = +-123.16
    grid = {struct.unpack("<I", struct.pack("<f", 2.0 ** (j / 18)))[0] & 0x7FFFFF for j in range(18)}
    for s in scales:  # every int8 scale is 0, the flag, or on the grid: 2^e * G[j]
        assert int(s, 16) in (0, 0x7FC00000) or int(s, 16) & 0x7FFFFF in grid, s
    assert scales[4] == "00000000" and q[4 * B : 5 * B] == bytes(B)  # subnormals: a / 127.5 rounds to 0
    assert scales[5] == "00800000"  # a ~ 1e-36: a / 127.5 is subnormal, the scale 2^-126
    assert scales[7] == scales[8] == "7fc00000" and q[7 * B :] == bytes(len(q) - 7 * B)  # the flag
    assert 0x81 in q and 0x80 not in q  # -127 occurs, -128 never


# ---------------------------------------------------------------------------
# the ring's payload: docs/wire-format.md "On the wire", built by hand


GRID_MANTISSAS = [struct.unpack("<I", struct.pack("<f", 2.0 ** (j / 18)))[0] & 0x7FFFFF for j in range(18)]


def grid_index(u: int) -> int:
    """k = 18 e + j of the int8 scale 2^e * G[j] (as fp32 bits)."""
    return 18 * (u >> 23) + GRID_MANTISSAS.index(u & 0x7FFFFF)


def int8_payload_by_hand(scales_hex: str, q_hex: str) -> bytes:
    """2 bytes: K, the largest grid index of the nonzero finite scales (little-endian); a byte a
    block: K - k, 254 for a zero scale (or one more than 253 steps below K), 255 for the flag;
    then the len int8 values."""
    words = _words(scales_hex)
    top = max((grid_index(u) for u in words if u not in (0, 0x7FC00000)), default=0)
    out = struct.pack("<H", top)
    for u in words:
        if u == 0x7FC00000:
            out += b"\xff"
        elif u == 0 or top - grid_index(u) > 253:
            out += b"\xfe"
        else:
            out += bytes([top - grid_index(u)])
    return out + bytes.fromhex(q_hex)


def flushed(decoded_hex: str, q: bytes, blocks: range, zero: str) -> str:
    """decoded_hex with the values of `blocks` replaced by the zero of their code's sign
    (a block the ring sends with the zero scale decodes as code * 0)."""
    out = decoded_hex.split()
    for blk in blocks:
        for i in range(blk * B, min((blk + 1) * B, len(out))):
            out[i] = ("8" if q[i] >= 128 else "0") + zero
    return " ".join(out)


@needs_ext
def test_ring_int8_payload_layout():
    C = _extension.require()
    g = GOLDEN["fp32"]
    x = f32(g["x"])
    payload, finite = C._ring_encode_input(x, "int8", B)
    assert not finite  # blocks 7 and 8 hold NaN / Inf: the ring refuses to send this data
    assert payload == int8_payload_by_hand(g["scales"], g["q"])
    assert len(payload) == ops.wire_bytes(x.numel(), B) == 2 + 9 + x.numel()
    # block 5 (a ~ 1e-36, scale 2^-126) lies 4447 grid steps below block 6 (a = FLT_MAX): it travels
    # as a zero scale (254), and so it does 2214 steps below block 0 in the payload of blocks 0-5
    assert payload[2 + 5] == 0xFE and payload[2 + 3] == 0xFE and payload[2 + 7] == payload[2 + 8] == 0xFF
    # the owner's final value: encoded the same way, and decoded as the format says
    m = 6 * B  # blocks 0-5
    scales6, q6 = " ".join(g["scales"].split()[:6]), g["q"][: 2 * m]
    payload, finite = C._ring_encode_final(x[:m].contiguous(), "float32", "int8", B)
    assert finite and payload == int8_payload_by_hand(scales6, q6)
    q = bytes.fromhex(g["q"])
    out = C._ring_decode_final(payload, torch.empty(m), "int8", B)
    want = " ".join(g["decoded_fp32"].split()[:m])
    assert_floats_golden(out, flushed(want, q, range(5, 6), "0000000"), "ring decode fp32")
    out = C._ring_decode_final(payload, torch.empty(m, dtype=torch.bfloat16), "int8", B)
    want = " ".join(g["decoded_bf16"].split()[:m])
    assert_floats_golden(out, flushed(want, q, range(5, 6), "000"), "ring decode bf16")
    # block 6 (a = FLT_MAX): -FLT_MAX decodes to ff7fa863, finite in fp32, -inf in bf16
    assert g["decoded_fp32"].split()[7 * B - 1] == "ff7fa863" and g["decoded_bf16"].split()[7 * B - 1] == "ff80"
    payload7 = int8_payload_by_hand(" ".join(g["scales"].split()[:7]), g["q"][: 2 * 7 * B])
    payload, finite = C._ring_encode_final(x[: 7 * B].contiguous(), "float32", "int8", B)
    assert finite and payload == payload7
    payload, finite = C._ring_encode_final(x[: 7 * B].contiguous(), "bfloat16", "int8", B)
    assert not finite  # the owner flags the overflow before anyone writes
    assert payload == payload7
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


def fp4_payload_by_hand(scales_hex: str, q_hex: str) -> bytes:
    """ceil(len/B) fp32 scales, little-endian, then the ceil(len/2) bytes of fp4 codes."""
    return b"".join(struct.pack("<I", u) for u in _words(scales_hex)) + bytes.fromhex(q_hex)


@needs_ext
def test_ring_fp4_payload_layout():
    C = _extension.require()
    g = GOLDEN["fp4"]["fp32"]
    x = f32(g["x"])
    payload, finite = C._ring_encode_input(x, "fp4", B)
    assert not finite  # block 7 holds a NaN: the ring refuses to send this data
    assert payload == fp4_payload_by_hand(g["scales"], g["q"])
    assert len(payload) == ops.wire_bytes(x.numel(), B, "fp4") == (x.numel() + 1) // 2 + 4 * 9
    m = 6 * B  # blocks 0-5 (block 6 holds FLT_MAX)
    payload, finite = C._ring_encode_final(x[:m].contiguous(), "float32", "fp4", B)
    assert finite and payload == fp4_payload_by_hand(_fp4_words(g["scales"], 6), g["q"][: m])
    for dtype, key in ((torch.float32, "decoded_fp32"), (torch.bfloat16, "decoded_bf16")):
        out = C._ring_decode_final(payload, torch.empty(m, dtype=dtype), "fp4", B)
        assert_floats_golden(out, _fp4_words(g[key], m), f"ring fp4 decode {dtype}")
    for dtype in (torch.bfloat16, torch.float16):
        h = GOLDEN["fp4"][str(dtype).removeprefix("torch.")]
        payload, finite = C._ring_encode_input(f16(h["x"], dtype), "fp4", B)
        assert finite and payload == fp4_payload_by_hand(h["scales"], h["q"]), dtype


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
        'scales': '3e000000 3c050672 3cf6544d 00000000 00000000 00800000 7c050672 7fc00000 7fc00000',
        'q': (
            '7f817f000002fe02fe047e827e8240c0000000029c102c30a6e6080e66667c04cc6feba8157becca1cc220b2f9dbb006'
            '7685b5c2ef02fab0de0e772322e120c78585858585858585858585858585858585858585858585858585858585858585'
            '000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000'
            '000000000000000000000000000000004ebf2c3aeb06ca0855c53e12bf2bd211d53cdc042cb350ee390b351fdc101b55'
            'bedd3c9babdf4c58f7169dd24aaaa3bc6be5deb852a656f0a04f9e06a7b3a78500000000000000000000000000000000'
            '0000000000000000000000000000000000000000000000'
        ),
        'decoded_fp32': (
            '417e0000 c17e0000 417e0000 00000000 00000000 3e800000 be800000 3e800000 be800000 3f000000 '
            '417c0000 c17c0000 417c0000 c17c0000 41000000 c1000000 00000000 00000000 00000000 3e800000 '
            'c1480000 40000000 40b00000 40c00000 c1340000 c0500000 3f800000 3fe00000 414c0000 414c0000 '
            '41780000 3f000000 bed82a79 3f66b72e be2e9876 bf36e8dd 3e2e9876 3f7fa863 be26480e bee07ae0 '
            '3e68cb48 bf00de3e 3e850672 bf221fdb bd68cb48 be99cf74 bf26480e 3d4789ab 3f7543e2 bf7fa863 '
            'bf1be38e bf00de3e be0d56d9 3c850672 bd4789ab bf26480e be8d56d9 3de8cb48 3f7757fc 3e917f0d '
            '3e8d56d9 be80de3e 3e850672 beecf37b c06cb502 c06cb502 c06cb502 c06cb502 c06cb502 c06cb502 '
            'c06cb502 c06cb502 c06cb502 c06cb502 c06cb502 c06cb502 c06cb502 c06cb502 c06cb502 c06cb502 '
            'c06cb502 c06cb502 c06cb502 c06cb502 c06cb502 c06cb502 c06cb502 c06cb502 c06cb502 c06cb502 '
            'c06cb502 c06cb502 c06cb502 c06cb502 c06cb502 c06cb502 00000000 00000000 00000000 00000000 '
            '00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 '
            '00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 '
            '00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 '
            '00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 '
            '00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 '
            '00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 '
            '039c0000 83820000 03300000 03680000 82a80000 01c00000 83580000 02000000 03aa0000 836c0000 '
            '03780000 02900000 83820000 032c0000 83380000 02880000 832c0000 03700000 83100000 01800000 '
            '03300000 839a0000 03a00000 82900000 03640000 02300000 03540000 02f80000 83100000 02800000 '
            '02d80000 03aa0000 ff092ea6 fe917f0d 7ef96c16 ff51ee2c ff30ac8f fe892ea6 7f1df7a7 7f36e8dd '
            'fd95a740 7e36e8dd ff4dc5f8 febf3944 7f19cf74 ff32c0a9 ff414d5e ff0d56d9 7f5e66c7 fe607ae0 '
            'fe8d56d9 ff15a740 7f2a7042 ff3b1110 7f32c0a9 fe050672 ff4789ab 7f2433f5 ff4bb1df 7d4789ab '
            'ff38fcf7 ff200bc1 ff38fcf7 ff7fa863 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 '
            '7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 '
            '7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 '
            '7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 '
            '7fc00000 7fc00000 7fc00000'
        ),
        'decoded_bf16': (
            '417e c17e 417e 0000 0000 3e80 be80 3e80 be80 3f00 417c c17c 417c c17c 4100 c100 0000 0000 '
            '0000 3e80 c148 4000 40b0 40c0 c134 c050 3f80 3fe0 414c 414c 4178 3f00 bed8 3f67 be2f bf37 '
            '3e2f 3f80 be26 bee0 3e69 bf01 3e85 bf22 bd69 be9a bf26 3d48 3f75 bf80 bf1c bf01 be0d 3c85 '
            'bd48 bf26 be8d 3de9 3f77 3e91 3e8d be81 3e85 beed c06d c06d c06d c06d c06d c06d c06d c06d '
            'c06d c06d c06d c06d c06d c06d c06d c06d c06d c06d c06d c06d c06d c06d c06d c06d c06d c06d '
            'c06d c06d c06d c06d c06d c06d 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 '
            '0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 '
            '0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 '
            '0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 039c 8382 '
            '0330 0368 82a8 01c0 8358 0200 03aa 836c 0378 0290 8382 032c 8338 0288 832c 0370 8310 0180 '
            '0330 839a 03a0 8290 0364 0230 0354 02f8 8310 0280 02d8 03aa ff09 fe91 7ef9 ff52 ff31 fe89 '
            '7f1e 7f37 fd96 7e37 ff4e febf 7f1a ff33 ff41 ff0d 7f5e fe60 fe8d ff16 7f2a ff3b 7f33 fe05 '
            'ff48 7f24 ff4c 7d48 ff39 ff20 ff39 ff80 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 '
            '7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 '
            '7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0'
        ),
        'decoded_fp16': (
            '4bf0 cbf0 4bf0 0000 0000 3400 b400 3400 b400 3800 4be0 cbe0 4be0 cbe0 4800 c800 0000 0000 '
            '0000 3400 ca40 4000 4580 4600 c9a0 c280 3c00 3f00 4a60 4a60 4bc0 3800 b6c1 3b36 b175 b9b7 '
            '3175 3bfd b132 b704 3346 b807 3428 b911 ab46 b4ce b932 2a3c 3baa bbfd b8df b807 b06b 2428 '
            'aa3c b932 b46b 2f46 3bbb 348c 346b b407 3428 b768 c366 c366 c366 c366 c366 c366 c366 c366 '
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
            '4187e213 4000af27 beb6be85 bfb97467 be34942a bfd65478 4082ca56 c0039249 c082a989 bfbc5d06 '
            '3d8f4a2c c06f9d6c bf04958f c03a46a0 3eff9547 bfbd93eb bebba146 be71080f 406d86b6 403fe82a '
            '400d713e c0182cf8 c058cf66 401f3706 c0689525 c002a4c0 3fd497a8 c007626f 40103058 c03df8d1 '
            '40777161 c0796ad8 c04c1d82 bfed51aa c0420f38 bfad6c28 be8ec7e0 c0d0fcf7 be0abea0 c0a1e887 '
            'c0183301 c01f6771 c08bab9e c0caaf7f be90c0a8 c059c3f5 c07add42 3dd6aa80 c0cdf80a c01ae532 '
            'c05307ec be88af08 c0b320e8 bf12e6c0 bf88ea70 bff395dc c0c507e0 c0d3b220 c08b9ebd bfaeb0a2 '
            'c0497f7a c0b36467 bfdeb4da c08767b1 bf62dbe8 c08d63aa c01f0fc7 c059c564 c03b11a5 bf6b3916 '
            'c0399a39 c07a4c27 3fb40e89 c0189e35 400a81b1 4066105b 40320c46 401afe86 401c4c57 40667795 '
            'bfd94404 400ccd16 404b6d40 3ec583c0 3f16fa5c 3ed9e40c bf1a68e0 40316a4b 3fb4985a bf9e425a '
            '3ff86742 bf7794d4 403974e3 c04d50ef bec72991 bf51018b 4009e056 c0085705 3f73a199 3e575375 '
            'be6c161e 3f6a9906 3fb2412d 3f2a1112 3fb0ab6d 3f9078c4 c018e55c bf1f2dfd c0637337 4064bc92 '
            'c06f17fd c075f35a 405c17d6 3fb512e8 bfa61e13 3f974da0 bfac4244 40072737 3fd38c5e bff4104b '
            'bf909e8c 3fa03147 c05c57ef bdb35d3f 3f8f5d14 4068ff80 407c91dd 405ce53c 406fd203 40617a33 '
            '406f42ce 3f1c67f8 c046c245 407eb4ec c06c7875 c050994d c010b73f 3e188fde 40629be6 4043d66a '
            'bfd27b63 4073e4e3 405d0e56 bfbb3a14 3de57ec2 402ac100 3fe63ab7 bf8542e8 bf97e8c3 bfee7ed7 '
            '3f830825 bf435565 3ee2c336 c028cd04 406b5aff 40184199 400fab12 be5328f2 bf944ce8 bf3270d1 '
            '3f0bce7b bff0f733 ff092ea6 fe917f0d 7ef96c16 ff51ee2c ff30ac8f fe892ea6 7f1df7a7 7f36e8dd '
            'fd95a740 7e36e8dd ff4dc5f8 febf3944 7f19cf74 ff32c0a9 ff414d5e ff0d56d9 7f5e66c7 fe607ae0 '
            'fe8d56d9 ff15a740 7f2a7042 ff3b1110 7f32c0a9 fe050672 ff4789ab 7f2433f5 ff4bb1df 7d4789ab '
            'ff38fcf7 ff200bc1 ff38fcf7 ff7fa863 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 '
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
        'scales': '40800000 3cc382ff 389550d3',
        'q': (
            '7f8154e2fcf60c02863cced6c02e72ce766222b8ceee346460845eb4326a842caa1bba6edd7ab04f8393b8b8f0f81ebc'
            '97c5576dde9c128ea213cc1ffe27d6cbc6e2ec7e35'
        ),
    },
    'float16': {
        'x': (
            '5ff0 dff0 5bd0 d4e0 50c0 5cc8 d810 de58 dc98 5b50 df28 5c48 d950 4c80 5ed8 d5e0 d9b0 d520 '
            '5cd8 59b0 4600 deb8 da10 5040 5c78 52c0 5760 5760 5c78 5c38 56a0 dc58 3e0f b7ff bbab 3c95 '
            '41bc 3d55 bb0e 3e53 3dd9 3fbc c1ef bb0a b658 3803 bf77 409f 418f 418c 32f2 bd9c c04f bb99 '
            'b89b be8e 4132 bdc1 4105 344d c16c 4199 4128 41bf 9e50 1de3 9e5d 1fd6 1511'
        ),
        'scales': '40800000 3cc382ff 38800000',
        'q': (
            '7f813eec0a4ce09ab63a8e44d6046ee8d2ec4e2e0294d008480e1e1e48441aba3febd8307838db423d5184dbef15b261'
            '747409c5a6d8e8bb6dc4690b8e756c789b5e9a7d14'
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
        'scales': '3e000000 3c050672 3cf6544d 3c850672',
        'q': {
            '0@0': (
                '7f817f000001fe02fe047e827e833fc00000ff039d102c31a5e6090e65667b04cd6feba7157becca1cc221b2f9dbb006'
                '7584b4c2ef01fbb0de0e782322e220c88585858585858585858585858585858585858585848585858585858585858585'
                'aa901396bd4b14ceca7456b1b44252db15032fb1fac36c95dd85abdb9616b2c6'
            ),
            '0@4294967232': (
                '7f817f000002fe03fe047e817f833fbf000000039d102c31a6e6090e65667b03cd6feca8157becca1cc220b2f9dbb006'
                '7685b5c2ef02fab0de0e772322e220c78585858585858584858585848585858585858485858585858585858585858585'
                'aa911496bd4b14cfca7556b0b44252db150330b1fac36d95de85acdc9616b2c6'
            ),
            '0@1103806595040': (
                '7f817f010001fe02fe047d817e8340bf000000029d112d31a5e7090e65677c04cc6feba8157becca1dc220b1fadab006'
                '7585b5c3ef02fab0de0e772322e120c78585858585858585858585858585858585858585858585858585858585858584'
                'aa911496bd4c13cec97456b0b34251db15042fb2fac36c95dd85acdc9716b3c6'
            ),
            '0@9223372036854775680': (
                '7f817f00ff02fe03fe037e817e8240bf000000029d112c30a6e7080f65677b03cc6feba8167becca1dc220b2f9dab006'
                '7684b4c2ef02fab0dd0e782322e220c78585858585858585858585858585858584858585858485858585858585858585'
                'aa911396bd4b13ceca7456b1b44152db14032fb2fac36c95dd85abdb9616b3c6'
            ),
            '2654435769@0': (
                '7f817f00ff02fe02fe047e827e823fc00000ff029c102c31a6e7080f65667c04cc6feba8157becca1cc220b2f9daaf06'
                '7685b5c3ef01fab0dd0e782422e120c78585858585858585858585858585858585858585858585858585858585858585'
                'aa911396bd4b13cfc97456b0b44252db14042fb1fac36d95de85acdb9616b2c6'
            ),
            '2654435769@4294967232': (
                '7f817f01ff01ff03fe037e827e8240bf0000ff029c102d30a5e6080e66667c03cd6feca8167becca1cc221b2f9daaf06'
                '7585b5c2ef02fab0de0e772322e120c78585858585858584858585858585858585858585858584858585858585858585'
                'aa911496bd4b13cfca7456b0b44251da14032fb1fbc36c95de85abdb9616b2c6'
            ),
            '2654435769@1103806595040': (
                '7f817f010002fe03fd037d817f8340c00000ff029d102c30a5e6090f66667c04cc6feba8157becca1cc220b2f9dbb006'
                '7685b5c3ef02fbb0de0e772322e220c78485858585858585858585858585858585858585858585858585858585858585'
                'aa911496be4c13ceca7456b1b34152da14042fb1fbc36c95dd86abdc9616b2c6'
            ),
            '2654435769@9223372036854775680': (
                '7f817f00ff01fe02fe037d827f823fc00000ff029d112c31a6e7080e65667c03cd6feba8157becca1cc220b2fadbb006'
                '7685b5c3ef01fab0de0e772322e120c78585858585858585858485858585858585858585858585858585858585858484'
                'aa911496bd4c14ceca7556b1b44152db14032fb1fac36d95de85acdb9616b2c6'
            ),
            '4294967295@0': (
                '7f817f010001ff03fe047e827e8240bf0000ff039d102d30a5e6080f65667b04cc6feca8157becca1cc320b2f9dbaf06'
                '7585b4c3ef01fab0de0e772322e220c78585858585858585858585858585858585858585858584858585858585858585'
                'aa911496bd4c13ceca7456b1b44252da140430b1fac36d95dd85abdb9616b3c6'
            ),
            '4294967295@4294967232': (
                '7f817f000001fe02fe047e817e8240c00000ff029c102c30a6e6090f65677b03cc6feca8167becca1cc221b1fadbb006'
                '7685b5c2ef02fab0de0f782322e120c88585858585858585858585858585858585858585858485858585858585848585'
                'aa911396bd4b13cfca7557b1b34252da14032fb1fac36c95de85acdb9616b2c6'
            ),
            '4294967295@1103806595040': (
                '7f817f000001fe02fd037d827f823fc0000000029c102d31a5e6080e66667c04cd6feba8157cecca1dc220b2f9dab006'
                '7684b5c2ef02fab0de0f772322e220c78585858585858585858584858585858585858585858585858585858585858585'
                'aa901396bd4c13cfca7456b0b44151db15042fb1fac36d95dd85acdb9616b3c6'
            ),
            '4294967295@9223372036854775680': (
                '7f817f010002fe02fd047e827e8240c0000000039d112d30a6e6090e65667b03cd6feca8157becca1cc221b2f9dbb006'
                '7585b5c3ef02fab0dd0e772322e120c88585858585858585858585858585858585858485848585858585858585858585'
                'aa911396bd4c13ceca7456b1b44151db15042fb1fac36d95dd85abdb9616b2c6'
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
    'fp4': {
        'fp32': {
            'x': (
                '3fc00000 bfc00000 3d800000 3e400000 3ea00000 3ee00000 3f200000 3f600000 3fa00000 bd800000 '
                'be400000 bea00000 bee00000 bf200000 bf600000 bfa00000 3d7fffff 3d800001 3e3fffff 3e400001 '
                '3e9fffff 3ea00001 3edfffff 3ee00001 3f1fffff 3f200001 3f5fffff 3f600001 3f9fffff 3fa00001 '
                'bccccccd 80000000 be9bd096 bb3821a8 3f53175c 3ee3c3b8 beee416b 3f800000 3f59c226 bf214ad2 '
                'becc027d bdc8ab8a beadd453 3f4e4e60 be689b38 bea5782e 3e77cbef 3bba0fca beb127ba bf800000 '
                '3f7dc53d 3f626dd8 3e4eb466 3cb79fa8 bed3075c 3eb972ff 3d895042 3d0bef14 3f458a6e 3f6faafb '
                'bf5f97af 3f1f4811 3f7025ee 3c71c4c7 c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd '
                'c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd '
                'c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd '
                'c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd 80000000 00000000 00000000 80000000 '
                '00000000 00000000 80000000 00000000 00000000 80000000 00000000 00000000 80000000 00000000 '
                '00000000 80000000 00000000 00000000 80000000 00000000 00000000 80000000 00000000 00000000 '
                '80000000 00000000 00000000 80000000 00000000 00000000 80000000 00000000 8000002f 00000020 '
                '8000001b 00000002 00000035 8000000f 00000005 00000009 00000011 0000001b 00000035 80000007 '
                '0000001a 00000002 80000017 80000010 80000002 0000003a 80000021 80000009 00000014 80000006 '
                '00000017 00000021 80000005 80000003 0000000c 80000002 0000001a 80000016 00000030 00000039 '
                '02f0df88 83846297 82fc71e7 03930999 81a98ffb 834c922a 03552326 0247f4cb 03a0a959 0376218a '
                '83826666 02941c0f 807f0ebf 0396563f 82b47767 82af22d4 0373f604 8363336b 83337f17 835ac339 '
                '836d8247 81eb2b71 82df66b0 831ccb7b 80e32fb5 832f583e 831d2a5d 02e7a851 83575cd1 83235f49 '
                '8314fd7a 03aa2425 fe301713 7eee1f28 fee8f72e ff608faf 7dcc100d 7f4d7130 7ea034c4 ff3b14b4 '
                'fe2bafa1 7f1a7e54 fe56f6f1 7f33adbe 7ef0250b 7eab1489 fec0456c 7f0610e6 7d2a4429 fe6d5405 '
                'fd510b25 fe8105d7 7f1704c0 feee1b0f fe9ed1d1 7d658320 ff4b3b3d 7f405e84 7dc658b8 7f4eabbb '
                'ff4386f0 7f4d5b94 ff21a764 ff7fffff be1dd5cb 3f436eef be5f3bdb 3d06e681 be818022 bf1338d1 '
                '3d073dd5 3ea75119 bef25d00 3f64e8fa bf7a45f8 7fc00000 beb7d5f4 bf0a3434 bb9364d0 bf669708 '
                'bf482cb1 bed3a72a 3f778d8e bf6d21d3 be5fa0fa bf6c124e 3efa6c3c 3e93376d 3d6de736 3e5e25b1 '
                'bf49e1d6 3f22821d bf7f67e0 3ea056cb 3ce5b845 3c8c8a48 be005305 3ededeab 3e7f3adc 3f0cf7f2 '
                '3ea4ab6f bf232a5e 3e861430'
            ),
            'scales': '3e800000 3e2aaaab 3f1dddde 00000000 0000000a 0262dadc 7e2aaaaa 7fc00000 3dd98dd3',
            'q': (
                'f720426406aaccee10213243546576000c567de79c6ccb03fc77024c01766f07ffffffffffffffffffffffffffffffff'
                '0000000000000000000000000000000000000000000000000000000000000000e47ce926673e70bbe6ed9edcd04dde7d'
                '5afd61e46a6b455cb0b9d61c6e616efe000000000000000000000000000000006a74f504'
            ),
            'decoded_fp32': (
                '3fc00000 bfc00000 00000000 3e800000 3e800000 3f000000 3f000000 3f800000 3f800000 00000000 '
                'be800000 be800000 bf000000 bf000000 bf800000 bf800000 00000000 3e000000 3e000000 3e800000 '
                '3e800000 3ec00000 3ec00000 3f000000 3f000000 3f400000 3f400000 3f800000 3f800000 3fc00000 '
                '00000000 00000000 beaaaaab 00000000 3f2aaaab 3f000000 bf000000 3f800000 3f800000 bf2aaaab '
                'beaaaaab bdaaaaab beaaaaab 3f2aaaab be800000 beaaaaab 3e800000 00000000 beaaaaab bf800000 '
                '3f800000 3f800000 3e2aaaab 00000000 beaaaaab 3eaaaaab 3daaaaab 00000000 3f2aaaab 3f800000 '
                'bf800000 3f2aaaab 3f800000 00000000 c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd '
                'c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd '
                'c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd '
                'c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd 00000000 00000000 00000000 00000000 '
                '00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 '
                '00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 '
                '00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 '
                '00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 '
                '00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 '
                '00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 '
                '02e2dadc 8362dadc 82e2dadc 03aa2425 81e2dadc 8362dadc 0362dadc 0262dadc 03aa2425 0362dadc '
                '8362dadc 02aa2425 00000000 03aa2425 82aa2425 82aa2425 0362dadc 8362dadc 832a2425 8362dadc '
                '8362dadc 81e2dadc 82e2dadc 832a2425 00000000 832a2425 832a2425 02e2dadc 8362dadc 832a2425 '
                '832a2425 03aa2425 fe2aaaaa 7effffff feffffff ff7fffff 7daaaaaa 7f2aaaaa 7eaaaaaa ff2aaaaa '
                'fe2aaaaa 7f2aaaaa fe7fffff 7f2aaaaa 7effffff 7eaaaaaa feaaaaaa 7effffff 00000000 fe7fffff '
                'fdaaaaaa fe7fffff 7f2aaaaa feffffff feaaaaaa 7daaaaaa ff2aaaaa 7f2aaaaa 7daaaaaa 7f2aaaaa '
                'ff2aaaaa 7f2aaaaa ff2aaaaa ff7fffff 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 '
                '7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 '
                '7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 '
                '7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 bdd98dd3 3ed98dd3 3e598dd3 3f232a5e '
                '3ea32a5e bf232a5e 3e598dd3'
            ),
            'decoded_bf16': (
                '3fc0 bfc0 0000 3e80 3e80 3f00 3f00 3f80 3f80 0000 be80 be80 bf00 bf00 bf80 bf80 0000 3e00 '
                '3e00 3e80 3e80 3ec0 3ec0 3f00 3f00 3f40 3f40 3f80 3f80 3fc0 0000 0000 beab 0000 3f2b 3f00 '
                'bf00 3f80 3f80 bf2b beab bdab beab 3f2b be80 beab 3e80 0000 beab bf80 3f80 3f80 3e2b 0000 '
                'beab 3eab 3dab 0000 3f2b 3f80 bf80 3f2b 3f80 0000 c06d c06d c06d c06d c06d c06d c06d c06d '
                'c06d c06d c06d c06d c06d c06d c06d c06d c06d c06d c06d c06d c06d c06d c06d c06d c06d c06d '
                'c06d c06d c06d c06d c06d c06d 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 '
                '0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 '
                '0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 '
                '0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 02e3 8363 '
                '82e3 03aa 81e3 8363 0363 0263 03aa 0363 8363 02aa 0000 03aa 82aa 82aa 0363 8363 832a 8363 '
                '8363 81e3 82e3 832a 0000 832a 832a 02e3 8363 832a 832a 03aa fe2b 7f00 ff00 ff80 7dab 7f2b '
                '7eab ff2b fe2b 7f2b fe80 7f2b 7f00 7eab feab 7f00 0000 fe80 fdab fe80 7f2b ff00 feab 7dab '
                'ff2b 7f2b 7dab 7f2b ff2b 7f2b ff2b ff80 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 '
                '7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 '
                '7fc0 7fc0 7fc0 7fc0 bdda 3eda 3e5a 3f23 3ea3 bf23 3e5a'
            ),
            'decoded_fp16': (
                '3e00 be00 0000 3400 3400 3800 3800 3c00 3c00 0000 b400 b400 b800 b800 bc00 bc00 0000 3000 '
                '3000 3400 3400 3600 3600 3800 3800 3a00 3a00 3c00 3c00 3e00 0000 0000 b555 0000 3955 3800 '
                'b800 3c00 3c00 b955 b555 ad55 b555 3955 b400 b555 3400 0000 b555 bc00 3c00 3c00 3155 0000 '
                'b555 3555 2d55 0000 3955 3c00 bc00 3955 3c00 0000 c366 c366 c366 c366 c366 c366 c366 c366 '
                'c366 c366 c366 c366 c366 c366 c366 c366 c366 c366 c366 c366 c366 c366 c366 c366 c366 c366 '
                'c366 c366 c366 c366 c366 c366 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 '
                '0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 '
                '0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 '
                '0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 8000 '
                '8000 0000 8000 8000 0000 0000 0000 0000 8000 0000 0000 0000 8000 8000 0000 8000 8000 8000 '
                '8000 8000 8000 8000 0000 8000 8000 0000 8000 8000 8000 0000 fc00 7c00 fc00 fc00 7c00 7c00 '
                '7c00 fc00 fc00 7c00 fc00 7c00 7c00 7c00 fc00 7c00 0000 fc00 fc00 fc00 7c00 fc00 fc00 7c00 '
                'fc00 7c00 7c00 7c00 fc00 7c00 fc00 fc00 7e00 7e00 7e00 7e00 7e00 7e00 7e00 7e00 7e00 7e00 '
                '7e00 7e00 7e00 7e00 7e00 7e00 7e00 7e00 7e00 7e00 7e00 7e00 7e00 7e00 7e00 7e00 7e00 7e00 '
                '7e00 7e00 7e00 7e00 aecc 36cc 32cc 3919 3519 b919 32cc'
            ),
            'acc': (
                'c015fe8d bf1071aa c07a0f42 c04f909e 4078c785 3fdca1cb beb0783a 407844e6 4028b4e6 c00078cc '
                '3f6e54e0 c009ce9e c02fc276 c02c1573 be6958ee bfb28c08 404c54cd c018e8a6 403292e0 bf04bfa5 '
                'bf870e07 3f9d91b6 4002c366 c00730a0 400a398b 4006738c bf948199 40789420 bf49a7a3 bedb4946 '
                'bea53cba 400f8ca7 bf6064fc 40024747 406564c7 40186270 3f2554ea 3f22800a 3ed80419 400fcbcb '
                'c047feec 3f413fd6 4005a4f3 bf78dd12 4024a478 c025e4cf c0427841 bf39c85c c014bf83 c0072ac5 '
                'bfab5a7a bfb69830 4021ee89 c0047607 4005cb97 3f96ee34 3f2ee4e0 c0165a38 bf4117bb c069c210 '
                'c02a3c91 c04f0177 402093a8 40693037 4047eea8 403c0245 bfd587b3 c015ee61 c038a7e1 4038ba8b '
                'bf8d1279 c0602a27 bf44cc1f 3f734289 3da0996f 3ffd9a30 3fad7a67 404b08de bf95732a 3f6b6c76 '
                'c045bd60 3f11d84e 3fc512ce c004a590 3fbc15e4 bfe36969 c0661561 3fc08d95 bfc338f8 c019b88e '
                '40777972 40527208 4005dc9a 40530f38 c04a200f bfd2c753 3e7a6eb4 4064583d be409b03 3fa95c72 '
                'c02caf97 be886e18 bf7e10e8 404a0207 3fe62263 bf15d5d6 bf72f64e 40444dcb bf1185c3 c02133e2 '
                'bfea6e33 c0168c2a c053ab43 40435770 3fd39cdf 3f3b1186 3fad73c6 3fe1a019 bf65d58f c04085d1 '
                '3d7326f4 c02cae01 40451137 be6707fa 3fb22615 c064c1a3 3f45434a 3fb52b50 c065772d 3e850721 '
                '3f667984 c07141fd 4018848a c051d50e bfc753ec 3f791f3f c0226583 3f9b1bc4 c01e96c3 beaa372c '
                '400fe53a 3facccc5 c01ccdbd 403b7efe 4049c68d bf67bc3f 3f988220 3f87e57a c01fbea0 402999ba '
                '40439670 406a998b 4042634e 3f198255 4018c9f2 3faa604e 40490b0a bdb8e10c 401bd47e 4055de42 '
                '403c487f 400bcc40 3f18d272 3dd035ba c0214e0f 403c7104 c05a3d6a c013e9d7 bf8cf36d 3f09c768 '
                'c06f4df6 c052da94 404844c8 be7c357e c0436140 3fd4210e 407b6e5f bfe810ef 402e4700 c077a580 '
                '406282ad 40323346 bdf664ae 3fe1604e bfc80459 c077303e 3f06a8c3 bfe6cee2 3ff9bc12 c02c7a63 '
                'be3d27b9 3f88b274 c00e3767 c04495de c06810ed bfa205de bdd376a4 bf46b5c0 407db35c bfbbc649 '
                'c06bb613 bffded93 3fcdb455 c02d688a bfb8ecf6 4037a234 4074d6e9 3fabf6c6 bf76b68f 3f9bfd00 '
                '40100b1e c001a759 3e5fe2fc 407ac1a9 c0471598 c0258c35 c0102a4f 3ff68862 3d83f69c bf8458aa '
                'c00645d7 c07976dc bf84b0ce 4061fe56 40687b72 bee3b103 3fa8850c c05b01d5 3f8e9896 bfa4beea '
                'c05e8b13 bfd82566 40442d7c c00737a1 3f10cc48 bfa17b0e 3f420fe4 c00a4794 4005de4f bf98aba1 '
                '3fc7a76a c00274dc 401eeccc 403f4370 bf2332a5 bfca827f 3fb2d65d bfd26bdd c029e43a c00432ae '
                '4059199f 407cb6ed bf309fd0 3f6dcbaa 4005e873 4026aaec 40747a76 c01ab8ba c06cdb8e 3fe3ffdb '
                '400c6ef2 406abcba 3edde423'
            ),
            'acc_plus_decoded': (
                'bf57fa34 c0041c6a c07a0f42 c03f909e 408463c2 400e50e6 3e1f0f8c 409c2273 4068b4e6 c00078cc '
                '3f2e54e0 c019ce9e c04fc276 c04c1573 bf9d2b1e c0194604 404c54cd c010e8a6 403a92e0 be897f4a '
                'bf4e1c0e 3fcd91b6 401ac366 bfce6140 402a398b 4036738c bed20664 409c4a10 3e596174 3f892dae '
                'bea53cba 400f8ca7 bf9add29 40024747 408807b9 40386270 3e1553a8 3fd14005 3fb60106 3fca4240 '
                'c05d5441 3f2bea81 3fe09f3b be9c64ce 4014a478 c03b3a24 c0327841 bf39c85c c02a14d8 c0472ac5 '
                'bead69e8 beda60c0 402c9934 c0047607 3fe0ec83 3fc198df 3f443a35 c0165a38 bdb36880 c029c210 '
                'c06a3c91 c02456cc 406093a8 40693037 bf137894 bf432a20 c0abc853 c0c15d97 c0d2ba57 bf504908 '
                'c099ab05 c0e67b7a c08effea c02ffc2b c067c802 bfdbff6a c0160f9a bf070fbc c09bc331 c031f1b0 '
                'c0d94516 c04856ba c00a4366 c0b8b92e c00ec1db c0af40c1 c0e97117 c00c8602 c0a734a4 c0c342ae '
                '3e2aca50 bed2d628 bfcde066 becdeca8 c0db766e c0ab183b 3e7a6eb4 4064583d be409b03 3fa95c72 '
                'c02caf97 be886e18 bf7e10e8 404a0207 3fe62263 bf15d5d6 bf72f64e 40444dcb bf1185c3 c02133e2 '
                'bfea6e33 c0168c2a c053ab43 40435770 3fd39cdf 3f3b1186 3fad73c6 3fe1a019 bf65d58f c04085d1 '
                '3d7326f4 c02cae01 40451137 be6707fa 3fb22615 c064c1a3 3f45434a 3fb52b50 c065772d 3e850721 '
                '3f667984 c07141fd 4018848a c051d50e bfc753ec 3f791f3f c0226583 3f9b1bc4 c01e96c3 beaa372c '
                '400fe53a 3facccc5 c01ccdbd 403b7efe 4049c68d bf67bc3f 3f988220 3f87e57a c01fbea0 402999ba '
                '40439670 406a998b 4042634e 3f198255 4018c9f2 3faa604e 40490b0a bdb8e10c 401bd47e 4055de42 '
                '403c487f 400bcc40 3f18d272 3dd035ba c0214e0f 403c7104 c05a3d6a c013e9d7 bf8cf36d 3f09c768 '
                'c06f4df6 c052da94 404844c8 be7c357e c0436140 3fd4210e 407b6e5f bfe810ef 402e4700 c077a580 '
                '406282ad 40323346 bdf664ae 3fe1604e bfc80459 c077303e 3f06a8c3 bfe6cee2 3ff9bc12 c02c7a63 '
                'be3d27b9 3f88b274 fe2aaaaa 7effffff feffffff ff7fffff 7daaaaaa 7f2aaaaa 7eaaaaaa ff2aaaaa '
                'fe2aaaaa 7f2aaaaa fe7fffff 7f2aaaaa 7effffff 7eaaaaaa feaaaaaa 7effffff bf76b68f fe7fffff '
                'fdaaaaaa fe7fffff 7f2aaaaa feffffff feaaaaaa 7daaaaaa ff2aaaaa 7f2aaaaa 7daaaaaa 7f2aaaaa '
                'ff2aaaaa 7f2aaaaa ff2aaaaa ff7fffff 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 '
                '7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 '
                '7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 '
                '7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 406dae07 bfff0dff c05f42b1 401aca85 '
                '4020d43e 4041f222 3f255586'
            ),
        },
        'bfloat16': {
            'x': (
                '43fe c3fe 438b 42d4 4218 4356 c3f9 c326 4278 c35e c3a3 439b c332 43e9 c2d4 4372 433a 4362 '
                '43a9 4336 c33a 439f 428c 43ab 42bc c3b5 43a5 c3b5 433e c36e 438f 439d bfff 3d2e 3fea bfef '
                'c03a 401f bfc2 bd8d 3fc4 bfd0 bff4 bf12 bf83 bf9c 3fc2 be7e 3f51 bf12 bf54 c024 3f21 3d86 '
                'bff7 3f9a bc1a 3fec 3f99 c010 c02f 4001 bf2e c031 3bb6 bb9b bbac bb7c 3be0'
            ),
            'scales': '42a95555 3ef80000 3a955555',
            'q': 'f73551cfd16e7c5b54466c62e2e6d4650ee67f0dd5aedc95a3fb034e60e46ffbe6de07',
        },
        'float16': {
            'x': (
                '5ff0 dff0 5eb8 5e78 5fd8 5db8 de48 5970 d620 de38 df58 dc28 da70 d950 cc80 d460 5eb8 df38 '
                'def8 da70 dad0 57e0 5660 da90 53c0 d950 5dd8 5c98 5c68 5910 cd80 df28 2f78 bef7 382c 4150 '
                '4163 41bb 346f 3dd3 bc5e b7bb 3881 3e66 bc7a 3c95 bdcc 3f7f ad21 afc0 3416 b844 3d94 41b8 '
                'bdc6 3d2a b9d1 3aaf c06a 3f16 bc9b 3fdd be92 c1de 1869 9f65 9de3 9984 9e53'
            ),
            'scales': '42a95555 3efa5555 3a9dc000',
            'q': 'f767674eeadfcca0f7cf3dc2c15645f9e0727751ac524c6d00a1755d3b6e6cfdf4ce0f',
        },
        'stochastic': {
            'x': (
                '3fc00000 bfc00000 3d800000 3e400000 3ea00000 3ee00000 3f200000 3f600000 3fa00000 bd800000 '
                'be400000 bea00000 bee00000 bf200000 bf600000 bfa00000 3d7fffff 3d800001 3e3fffff 3e400001 '
                '3e9fffff 3ea00001 3edfffff 3ee00001 3f1fffff 3f200001 3f5fffff 3f600001 3f9fffff 3fa00001 '
                'bccccccd 80000000 be9bd096 bb3821a8 3f53175c 3ee3c3b8 beee416b 3f800000 3f59c226 bf214ad2 '
                'becc027d bdc8ab8a beadd453 3f4e4e60 be689b38 bea5782e 3e77cbef 3bba0fca beb127ba bf800000 '
                '3f7dc53d 3f626dd8 3e4eb466 3cb79fa8 bed3075c 3eb972ff 3d895042 3d0bef14 3f458a6e 3f6faafb '
                'bf5f97af 3f1f4811 3f7025ee 3c71c4c7 c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd '
                'c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd '
                'c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd '
                'c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd c06ccccd 3fbadd93 3fca2a7a bf1f1038 bfc55d58 '
                'be77b889 be450cc3 3f1c28f3 3f335b13 bf3f08a1 3f108dc1 3de38530 bea6f7c8 3dfd639f bdcbf708 '
                'bf8584eb bf50c4cd be89ac65 3f4ee6f4 bf4c05be be411ece be60410a 3f448870 3f957aff bf979df1 '
                'bfe09002 3d74f387 bfc10f11 bf976d3e 3f80c43e bfe7b6de 3f77879f bf886adc'
            ),
            'scales': '3e800000 3e2aaaab 3f1dddde 3e9a79e9',
            'q': {
                '0@0': (
                    'f711335497badbfd10212343445666009c467de69c6ccb03fc77024d11766f17ffffffffffffffffffffffffffffffff'
                    '66fc99443da191de4a9c59e50feff5e5'
                ),
                '0@4294967232': (
                    'f710436497aadced01222343455666000c577de79c6cca03fd67025d01766e07ffffffffffffffffffffffffffffffff'
                    '77ec9a544ca091de4aad5ae60feff6d5'
                ),
                '0@1103806595040': (
                    'f721335497a9dbee11123344545676000c577de69d6ccb03fc77134c11766e06ffffffffffffffffffffffffffffffff'
                    '66fc9a444ca091dd5aac59e50feff6d6'
                ),
                '0@9223372036854775680': (
                    'f711426407aacbee00123333556576000b567de79d7cca03fc77034c10776e07ffffffffffffffffffffffffffffffff'
                    '76fc9a444cb101de4aad4ae60fdef5e6'
                ),
                '2654435769@0': (
                    'f711425497bacbfd00112243556566000c577ce69c6ccb02fc77024c00775f07ffffffffffffffffffffffffffffffff'
                    '76ec99444ca191de59ac59e61feff5d5'
                ),
                '2654435769@4294967232': (
                    'f720326507bacbee00112234445567000c477de69c6ccb03fc77024c11766f17ffffffffffffffffffffffffffffffff'
                    '76fc9a443da191cd5a9d5ae60feff6e5'
                ),
                '2654435769@1103806595040': (
                    'f720436406a9dcfe00112333446667000b477de79d7ccb03fc77024d01766f07ffffffffffffffffffffffffffffffff'
                    '66ec9a444ca190ce599d5ae51feef6e5'
                ),
                '2654435769@9223372036854775680': (
                    'f711325407b9ccfd00113343555566090c467de69c6ccb03fd77024c01765f07ffffffffffffffffffffffffffffffff'
                    '76ec99444da191de4a9d59e60feff5d5'
                ),
                '4294967295@0': (
                    'f720336597bacbee00212334446566000b577dd6ac7cca03fc77024d11766e07ffffffffffffffffffffffffffffffff'
                    '67ec9a444ca191ce5a9d4ae60feff5e6'
                ),
                '4294967295@4294967232': (
                    'f711335497aacbfe10112233456676000c577dd69c6ccb03fc67034c11776f17ffffffffffffffffffffffffffffffff'
                    '77ec99544ca190ce5a9d59e60feff5e5'
                ),
                '4294967295@1103806595040': (
                    'f711335406b9ccfd01122244445567000c467ce79d7cca03fc67135d11766f07ffffffffffffffffffffffffffffffff'
                    '67fca9544da191dd5a9d59e60feff5d6'
                ),
                '4294967295@9223372036854775680': (
                    'f721435496bacbfe00223334455666000c477de79c7ccb03fc77024c10665f16ffffffffffffffffffffffffffffffff'
                    '77ec99444da001dd5a9c59d60feef5e5'
                ),
            },
        },
        'all_codes': {
            'q': (
                '000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f202122232425262728292a2b2c2d2e2f'
                '303132333435363738393a3b3c3d3e3f404142434445464748494a4b4c4d4e4f505152535455565758595a5b5c5d5e5f'
                '606162636465666768696a6b6c6d6e6f707172737475767778797a7b7c7d7e7f808182838485868788898a8b8c8d8e8f'
                '909192939495969798999a9b9c9d9e9fa0a1a2a3a4a5a6a7a8a9aaabacadaeafb0b1b2b3b4b5b6b7b8b9babbbcbdbebf'
                'c0c1c2c3c4c5c6c7c8c9cacbcccdcecfd0d1d2d3d4d5d6d7d8d9dadbdcdddedfe0e1e2e3e4e5e6e7e8e9eaebecedeeef'
                'f0f1f2f3f4f5f6f7f8f9fafbfcfdfeff'
            ),
            'scales': (
                '3f800000 3e800000 3eaaaaab 00000000 c0000000 00000002 0082ab1e 461c4000 7f61b1e6 7fc00000 '
                '40f00000 33800000 322bcc77 462a9555 3a83126f 40a00000'
            ),
            'decoded_fp32': (
                '00000000 00000000 3f000000 00000000 3f800000 00000000 3fc00000 00000000 40000000 00000000 '
                '40400000 00000000 40800000 00000000 40c00000 00000000 80000000 00000000 bf000000 00000000 '
                'bf800000 00000000 bfc00000 00000000 c0000000 00000000 c0400000 00000000 c0800000 00000000 '
                'c0c00000 00000000 00000000 3e000000 3e000000 3e000000 3e800000 3e000000 3ec00000 3e000000 '
                '3f000000 3e000000 3f400000 3e000000 3f800000 3e000000 3fc00000 3e000000 80000000 3e000000 '
                'be000000 3e000000 be800000 3e000000 bec00000 3e000000 bf000000 3e000000 bf400000 3e000000 '
                'bf800000 3e000000 bfc00000 3e000000 00000000 3eaaaaab 3e2aaaab 3eaaaaab 3eaaaaab 3eaaaaab '
                '3f000000 3eaaaaab 3f2aaaab 3eaaaaab 3f800000 3eaaaaab 3faaaaab 3eaaaaab 40000000 3eaaaaab '
                '80000000 3eaaaaab be2aaaab 3eaaaaab beaaaaab 3eaaaaab bf000000 3eaaaaab bf2aaaab 3eaaaaab '
                'bf800000 3eaaaaab bfaaaaab 3eaaaaab c0000000 3eaaaaab 00000000 00000000 00000000 00000000 '
                '00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 '
                '00000000 00000000 80000000 00000000 80000000 00000000 80000000 00000000 80000000 00000000 '
                '80000000 00000000 80000000 00000000 80000000 00000000 80000000 00000000 80000000 c0800000 '
                'bf800000 c0800000 c0000000 c0800000 c0400000 c0800000 c0800000 c0800000 c0c00000 c0800000 '
                'c1000000 c0800000 c1400000 c0800000 00000000 c0800000 3f800000 c0800000 40000000 c0800000 '
                '40400000 c0800000 40800000 c0800000 40c00000 c0800000 41000000 c0800000 41400000 c0800000 '
                '00000000 00000006 00000001 00000006 00000002 00000006 00000003 00000006 00000004 00000006 '
                '00000006 00000006 00000008 00000006 0000000c 00000006 80000000 00000006 80000001 00000006 '
                '80000002 00000006 80000003 00000006 80000004 00000006 80000006 00000006 80000008 00000006 '
                '8000000c 00000006 00000000 0182ab1e 0041558f 0182ab1e 0082ab1e 0182ab1e 00c400ad 0182ab1e '
                '0102ab1e 0182ab1e 014400ad 0182ab1e 0182ab1e 0182ab1e 01c400ad 0182ab1e 80000000 0182ab1e '
                '8041558f 0182ab1e 8082ab1e 0182ab1e 80c400ad 0182ab1e 8102ab1e 0182ab1e 814400ad 0182ab1e '
                '8182ab1e 0182ab1e 81c400ad 0182ab1e 00000000 476a6000 459c4000 476a6000 461c4000 476a6000 '
                '466a6000 476a6000 469c4000 476a6000 46ea6000 476a6000 471c4000 476a6000 476a6000 476a6000 '
                '80000000 476a6000 c59c4000 476a6000 c61c4000 476a6000 c66a6000 476a6000 c69c4000 476a6000 '
                'c6ea6000 476a6000 c71c4000 476a6000 c76a6000 476a6000 00000000 80000000 7ee1b1e6 80000000 '
                '7f61b1e6 80000000 7f800000 80000000 7f800000 80000000 7f800000 80000000 7f800000 80000000 '
                '7f800000 80000000 80000000 80000000 fee1b1e6 80000000 ff61b1e6 80000000 ff800000 80000000 '
                'ff800000 80000000 ff800000 80000000 ff800000 80000000 ff800000 80000000 7fc00000 7fc00000 '
                '7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 '
                '7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 '
                '7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 7fc00000 '
                '00000000 c0f00000 40700000 c0f00000 40f00000 c0f00000 41340000 c0f00000 41700000 c0f00000 '
                '41b40000 c0f00000 41f00000 c0f00000 42340000 c0f00000 80000000 c0f00000 c0700000 c0f00000 '
                'c0f00000 c0f00000 c1340000 c0f00000 c1700000 c0f00000 c1b40000 c0f00000 c1f00000 c0f00000 '
                'c2340000 c0f00000 00000000 b3c00000 33000000 b3c00000 33800000 b3c00000 33c00000 b3c00000 '
                '34000000 b3c00000 34400000 b3c00000 34800000 b3c00000 34c00000 b3c00000 80000000 b3c00000 '
                'b3000000 b3c00000 b3800000 b3c00000 b3c00000 b3c00000 b4000000 b3c00000 b4400000 b3c00000 '
                'b4800000 b3c00000 b4c00000 b3c00000 00000000 b2abcc77 31abcc77 b2abcc77 322bcc77 b2abcc77 '
                '3280d959 b2abcc77 32abcc77 b2abcc77 3300d959 b2abcc77 332bcc77 b2abcc77 3380d959 b2abcc77 '
                '80000000 b2abcc77 b1abcc77 b2abcc77 b22bcc77 b2abcc77 b280d959 b2abcc77 b2abcc77 b2abcc77 '
                'b300d959 b2abcc77 b32bcc77 b2abcc77 b380d959 b2abcc77 00000000 c6ffe000 45aa9555 c6ffe000 '
                '462a9555 c6ffe000 467fe000 c6ffe000 46aa9555 c6ffe000 46ffe000 c6ffe000 472a9555 c6ffe000 '
                '477fe000 c6ffe000 80000000 c6ffe000 c5aa9555 c6ffe000 c62a9555 c6ffe000 c67fe000 c6ffe000 '
                'c6aa9555 c6ffe000 c6ffe000 c6ffe000 c72a9555 c6ffe000 c77fe000 c6ffe000 00000000 bb83126f '
                '3a03126f bb83126f 3a83126f bb83126f 3ac49ba6 bb83126f 3b03126f bb83126f 3b449ba6 bb83126f '
                '3b83126f bb83126f 3bc49ba6 bb83126f 80000000 bb83126f ba03126f bb83126f ba83126f bb83126f '
                'bac49ba6 bb83126f bb03126f bb83126f bb449ba6 bb83126f bb83126f bb83126f bbc49ba6 bb83126f '
                '00000000 c1f00000 40200000 c1f00000 40a00000 c1f00000 40f00000 c1f00000 41200000 c1f00000 '
                '41700000 c1f00000 41a00000 c1f00000 41f00000 c1f00000 80000000 c1f00000 c0200000 c1f00000 '
                'c0a00000 c1f00000 c0f00000 c1f00000 c1200000 c1f00000 c1700000 c1f00000 c1a00000 c1f00000 '
                'c1f00000 c1f00000'
            ),
            'decoded_bf16': (
                '0000 0000 3f00 0000 3f80 0000 3fc0 0000 4000 0000 4040 0000 4080 0000 40c0 0000 8000 0000 '
                'bf00 0000 bf80 0000 bfc0 0000 c000 0000 c040 0000 c080 0000 c0c0 0000 0000 3e00 3e00 3e00 '
                '3e80 3e00 3ec0 3e00 3f00 3e00 3f40 3e00 3f80 3e00 3fc0 3e00 8000 3e00 be00 3e00 be80 3e00 '
                'bec0 3e00 bf00 3e00 bf40 3e00 bf80 3e00 bfc0 3e00 0000 3eab 3e2b 3eab 3eab 3eab 3f00 3eab '
                '3f2b 3eab 3f80 3eab 3fab 3eab 4000 3eab 8000 3eab be2b 3eab beab 3eab bf00 3eab bf2b 3eab '
                'bf80 3eab bfab 3eab c000 3eab 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 '
                '0000 0000 0000 0000 8000 0000 8000 0000 8000 0000 8000 0000 8000 0000 8000 0000 8000 0000 '
                '8000 0000 8000 c080 bf80 c080 c000 c080 c040 c080 c080 c080 c0c0 c080 c100 c080 c140 c080 '
                '0000 c080 3f80 c080 4000 c080 4040 c080 4080 c080 40c0 c080 4100 c080 4140 c080 0000 0000 '
                '0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 8000 0000 8000 0000 '
                '8000 0000 8000 0000 8000 0000 8000 0000 8000 0000 8000 0000 0000 0183 0041 0183 0083 0183 '
                '00c4 0183 0103 0183 0144 0183 0183 0183 01c4 0183 8000 0183 8041 0183 8083 0183 80c4 0183 '
                '8103 0183 8144 0183 8183 0183 81c4 0183 0000 476a 459c 476a 461c 476a 466a 476a 469c 476a '
                '46ea 476a 471c 476a 476a 476a 8000 476a c59c 476a c61c 476a c66a 476a c69c 476a c6ea 476a '
                'c71c 476a c76a 476a 0000 8000 7ee2 8000 7f62 8000 7f80 8000 7f80 8000 7f80 8000 7f80 8000 '
                '7f80 8000 8000 8000 fee2 8000 ff62 8000 ff80 8000 ff80 8000 ff80 8000 ff80 8000 ff80 8000 '
                '7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 '
                '7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 7fc0 0000 c0f0 4070 c0f0 '
                '40f0 c0f0 4134 c0f0 4170 c0f0 41b4 c0f0 41f0 c0f0 4234 c0f0 8000 c0f0 c070 c0f0 c0f0 c0f0 '
                'c134 c0f0 c170 c0f0 c1b4 c0f0 c1f0 c0f0 c234 c0f0 0000 b3c0 3300 b3c0 3380 b3c0 33c0 b3c0 '
                '3400 b3c0 3440 b3c0 3480 b3c0 34c0 b3c0 8000 b3c0 b300 b3c0 b380 b3c0 b3c0 b3c0 b400 b3c0 '
                'b440 b3c0 b480 b3c0 b4c0 b3c0 0000 b2ac 31ac b2ac 322c b2ac 3281 b2ac 32ac b2ac 3301 b2ac '
                '332c b2ac 3381 b2ac 8000 b2ac b1ac b2ac b22c b2ac b281 b2ac b2ac b2ac b301 b2ac b32c b2ac '
                'b381 b2ac 0000 c700 45ab c700 462b c700 4680 c700 46ab c700 4700 c700 472b c700 4780 c700 '
                '8000 c700 c5ab c700 c62b c700 c680 c700 c6ab c700 c700 c700 c72b c700 c780 c700 0000 bb83 '
                '3a03 bb83 3a83 bb83 3ac5 bb83 3b03 bb83 3b45 bb83 3b83 bb83 3bc5 bb83 8000 bb83 ba03 bb83 '
                'ba83 bb83 bac5 bb83 bb03 bb83 bb45 bb83 bb83 bb83 bbc5 bb83 0000 c1f0 4020 c1f0 40a0 c1f0 '
                '40f0 c1f0 4120 c1f0 4170 c1f0 41a0 c1f0 41f0 c1f0 8000 c1f0 c020 c1f0 c0a0 c1f0 c0f0 c1f0 '
                'c120 c1f0 c170 c1f0 c1a0 c1f0 c1f0 c1f0'
            ),
            'decoded_fp16': (
                '0000 0000 3800 0000 3c00 0000 3e00 0000 4000 0000 4200 0000 4400 0000 4600 0000 8000 0000 '
                'b800 0000 bc00 0000 be00 0000 c000 0000 c200 0000 c400 0000 c600 0000 0000 3000 3000 3000 '
                '3400 3000 3600 3000 3800 3000 3a00 3000 3c00 3000 3e00 3000 8000 3000 b000 3000 b400 3000 '
                'b600 3000 b800 3000 ba00 3000 bc00 3000 be00 3000 0000 3555 3155 3555 3555 3555 3800 3555 '
                '3955 3555 3c00 3555 3d55 3555 4000 3555 8000 3555 b155 3555 b555 3555 b800 3555 b955 3555 '
                'bc00 3555 bd55 3555 c000 3555 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 '
                '0000 0000 0000 0000 8000 0000 8000 0000 8000 0000 8000 0000 8000 0000 8000 0000 8000 0000 '
                '8000 0000 8000 c400 bc00 c400 c000 c400 c200 c400 c400 c400 c600 c400 c800 c400 ca00 c400 '
                '0000 c400 3c00 c400 4000 c400 4200 c400 4400 c400 4600 c400 4800 c400 4a00 c400 0000 0000 '
                '0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 8000 0000 8000 0000 '
                '8000 0000 8000 0000 8000 0000 8000 0000 8000 0000 8000 0000 0000 0000 0000 0000 0000 0000 '
                '0000 0000 0000 0000 0000 0000 0000 0000 0000 0000 8000 0000 8000 0000 8000 0000 8000 0000 '
                '8000 0000 8000 0000 8000 0000 8000 0000 0000 7b53 6ce2 7b53 70e2 7b53 7353 7b53 74e2 7b53 '
                '7753 7b53 78e2 7b53 7b53 7b53 8000 7b53 ece2 7b53 f0e2 7b53 f353 7b53 f4e2 7b53 f753 7b53 '
                'f8e2 7b53 fb53 7b53 0000 8000 7c00 8000 7c00 8000 7c00 8000 7c00 8000 7c00 8000 7c00 8000 '
                '7c00 8000 8000 8000 fc00 8000 fc00 8000 fc00 8000 fc00 8000 fc00 8000 fc00 8000 fc00 8000 '
                '7e00 7e00 7e00 7e00 7e00 7e00 7e00 7e00 7e00 7e00 7e00 7e00 7e00 7e00 7e00 7e00 7e00 7e00 '
                '7e00 7e00 7e00 7e00 7e00 7e00 7e00 7e00 7e00 7e00 7e00 7e00 7e00 7e00 0000 c780 4380 c780 '
                '4780 c780 49a0 c780 4b80 c780 4da0 c780 4f80 c780 51a0 c780 8000 c780 c380 c780 c780 c780 '
                'c9a0 c780 cb80 c780 cda0 c780 cf80 c780 d1a0 c780 0000 8002 0000 8002 0001 8002 0002 8002 '
                '0002 8002 0003 8002 0004 8002 0006 8002 8000 8002 8000 8002 8001 8002 8002 8002 8002 8002 '
                '8003 8002 8004 8002 8006 8002 0000 8000 0000 8000 0000 8000 0000 8000 0000 8000 0001 8000 '
                '0001 8000 0001 8000 8000 8000 8000 8000 8000 8000 8000 8000 8000 8000 8001 8000 8001 8000 '
                '8001 8000 0000 f7ff 6d55 f7ff 7155 f7ff 73ff f7ff 7555 f7ff 77ff f7ff 7955 f7ff 7bff f7ff '
                '8000 f7ff ed55 f7ff f155 f7ff f3ff f7ff f555 f7ff f7ff f7ff f955 f7ff fbff f7ff 0000 9c19 '
                '1019 9c19 1419 9c19 1625 9c19 1819 9c19 1a25 9c19 1c19 9c19 1e25 9c19 8000 9c19 9019 9c19 '
                '9419 9c19 9625 9c19 9819 9c19 9a25 9c19 9c19 9c19 9e25 9c19 0000 cf80 4100 cf80 4500 cf80 '
                '4780 cf80 4900 cf80 4b80 cf80 4d00 cf80 4f80 cf80 8000 cf80 c100 cf80 c500 cf80 c780 cf80 '
                'c900 cf80 cb80 cf80 cd00 cf80 cf80 cf80'
            ),
        },
    },
}
