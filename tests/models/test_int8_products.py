"""4-bit and 8-bit weights times activations quantized to 8 bits (app/models/int8_products.py):
the compiled kernel computes what its float64 reference computes, batching and threads change
no bit, GGUF blocks map onto its layouts exactly, and where it cannot run nothing chooses it."""

from __future__ import annotations

import sys

import pytest
import torch
from gguf.constants import GGMLQuantizationType as T

from app.models import int8_products as P
from app.models.quantized import (INT4_TYPES, QuantizedWeight, int4_form, int4_linear,
                                  int8_codes, pack_int8_raw, quantize_int8)
from tests.models.test_quantized import K, quantized_blocks, random_blocks, sixteen_group_blocks

needs_kernel = pytest.mark.skipif(not P.available(), reason="the kernel cannot run on this CPU")


def _nibble_weight(n: int, k: int, planes: int, seed: int) -> P.Int8Codes:
    gen = torch.Generator().manual_seed(seed)
    return P.nibble_codes([(torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen),
                            torch.rand(n, k // 32, generator=gen) * 0.01,
                            -torch.rand(n, k // 32, generator=gen) * 0.08) for _ in range(planes)])


def _byte_weight(n: int, k: int, seed: int) -> P.Int8Codes:
    gen = torch.Generator().manual_seed(seed)
    return P.byte_codes(torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen),
                        torch.rand(n, k // 32, generator=gen) * 0.002,
                        torch.randn(n, k // 32, generator=gen) * 0.01)


def _five_weight(n: int, k: int, seed: int) -> P.Int8Codes:
    gen = torch.Generator().manual_seed(seed)
    s = torch.rand(n, k // 32, generator=gen) * 0.002
    return P.five_codes(torch.randint(0, 32, (n, k), dtype=torch.uint8, generator=gen), s, -16 * s)


WEIGHTS = {
    "nibbles": lambda: _nibble_weight(104, 640, 1, 0),  # 13 groups of 8 outputs: uneven threads
    "two nibble planes": lambda: _nibble_weight(64, 576, 2, 1),  # 18 blocks: not a multiple of 8
    "bytes": lambda: _byte_weight(40, 1536, 2),
    "fives": lambda: _five_weight(48, 640, 3),
}


@needs_kernel
@pytest.mark.parametrize("name", WEIGHTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_computes_its_reference(name, dtype):
    w = WEIGHTS[name]()
    k = w.scales.shape[1] // w.planes * 32  # (inputs: blocks of 32 a plane)
    gen = torch.Generator().manual_seed(3)
    for rows in (1, 2, 3, 4, 5, 9):
        x = (torch.randn(rows, k, generator=gen) * 3).to(dtype)
        x[0, :32] = 0  # a block of zeros: no scale to divide by
        got = P.matmul(x, w)
        want = P.reference(x, w)
        assert got.dtype == torch.float32 and got.shape == (rows, w.codes.shape[0])
        assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()


@needs_kernel
@pytest.mark.parametrize("name", WEIGHTS)
def test_a_rows_result_does_not_depend_on_the_rows_beside_it_or_the_threads(name):
    w = WEIGHTS[name]()
    k = w.scales.shape[1] // w.planes * 32  # (inputs: blocks of 32 a plane)
    x = torch.randn(11, k, generator=torch.Generator().manual_seed(4))
    together = P.matmul(x, w)
    for rows in (1, 2, 3, 4, 7):
        parts = torch.cat([P.matmul(x[i:i + rows], w) for i in range(0, 11, rows)])
        assert torch.equal(parts, together)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(P.matmul(x, w), together)
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_the_torch_operator_is_the_same_product():
    w = WEIGHTS["bytes"]()
    x = torch.randn(3, 1536)
    got = torch.ops.ferrox.int8_matmul(x, w.codes, w.scales, w.offsets, w.layout, w.planes, torch.empty(0), 0.0)
    assert torch.equal(got, P.matmul(x, w))


def test_the_layouts_read_back_as_the_codes_and_scales_they_were_given():
    gen = torch.Generator().manual_seed(15)
    s, b = torch.rand(16, 8, generator=gen), torch.rand(16, 8, generator=gen)
    nib = torch.randint(0, 16, (16, 256), dtype=torch.uint8, generator=gen)
    five = torch.randint(0, 32, (16, 256), dtype=torch.uint8, generator=gen)
    byte = torch.randint(-128, 128, (16, 256), dtype=torch.int8, generator=gen)
    for w, codes in ((P.nibble_codes([(nib, s, b)]), nib), (P.five_codes(five, s, b), five),
                     (P.byte_codes(byte, s, b), byte)):
        assert torch.equal(P.logical_codes(w).reshape(16, 256), codes.to(torch.int16))
        assert torch.equal(_held(w), P.logical_codes(w).reshape(16, 256).double()
                           * P.logical_scales(w)[0].double().repeat_interleave(32, 1)
                           + P.logical_scales(w)[1].double().repeat_interleave(32, 1))
        assert all(torch.equal(a, v.to(torch.float16)) for a, v in zip(P.logical_scales(w), (s, b)))
    with pytest.raises(ValueError, match="groups of 8"):
        P.byte_codes(byte[:12], s[:12], b[:12])


@pytest.mark.parametrize("t", sorted(INT4_TYPES, key=lambda t: t.name), ids=lambda t: t.name)
def test_gguf_blocks_map_onto_the_layouts_exactly(t):
    """The weight the layouts hold is the blocks' float32 dequantization: bit for bit where
    the blocks' scales are float16 already; the k-quants' d * sc rounds to float16 (at most
    1/2048 of each scale and offset)."""
    gguf_py_quantizes = t in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)  # not the k-quants
    for raw in (random_blocks(t, seed=5),) + ((quantized_blocks(t, seed=6),) if gguf_py_quantizes else ()):
        w = int8_codes(int4_form(raw), t)
        assert w.layout == (P.NIBBLES if t in (T.Q4_0, T.Q4_1, T.Q4_K) else P.BYTES if t == T.Q8_0
                            else P.FIVES)
        assert w.scales.dtype == w.offsets.dtype == torch.float16
        exact = raw.dequantize().double()
        if t in (T.Q4_K, T.Q5_K):
            form = int4_form(raw)
            bound = ((form.s.abs() * 31 + form.b.abs()) * 2.0**-11).repeat_interleave(32, 1)
            assert ((_held(w) - exact).abs() <= bound).all()
        else:
            assert torch.equal(_held(w), exact)


def _held(w: P.Int8Codes) -> torch.Tensor:
    """The [N, K] weight `w` holds, read off its layout in float64: sum over planes of
    scale * code + offset. Each group of 8 outputs is stored interleaved: for each block (a
    pair of blocks in FIVES) and each 4 inputs q, the 8 outputs' 4 codes (NIBBLES: 4 bytes
    an output hold inputs 4q.. in their low nibbles and 16 + 4q.. in their high ones)."""
    n = w.codes.shape[0]
    g = n // 8
    held = 0
    for p in range(w.planes):
        if w.layout == P.NIBBLES:  # [group, plane, block, q (4), output, 4]
            raw = w.codes.reshape(g, w.planes, -1, 4, 8, 4)[:, p].permute(0, 3, 1, 2, 4)
            raw = raw.reshape(n, -1, 16)  # [n, blocks, 16]: inputs 0..15 low, 16..31 high
            codes = torch.cat((raw & 15, raw >> 4), dim=2)
        elif w.layout == P.FIVES:  # (one plane) [group, pair, 8 q x 32 nibbles + 2 x 32 fifth bits]
            t = w.codes.reshape(g, -1, 320).to(torch.int64)
            low = t[..., :256].reshape(g, -1, 8, 1, 8, 4)
            low = torch.cat((low & 15, low >> 4), dim=3)  # [group, pair, q, block, output, 4]
            sliced = t[..., 256:].reshape(g, -1, 1, 2, 8, 4)  # byte 4o + i of each block: bit q
            fifth = (sliced >> torch.arange(8).reshape(8, 1, 1, 1)) & 1
            codes = (low + 16 * fifth).permute(0, 4, 1, 3, 2, 5).reshape(n, -1, 32)
        else:  # [group, plane, block, q, output, 4]
            raw = w.codes.view(torch.int8).reshape(g, w.planes, -1, 8, 8, 4)[:, p]
            codes = raw.permute(0, 3, 1, 2, 4).reshape(n, -1, 32)
        s = w.scales.reshape(g, w.planes, -1, 8)[:, p].transpose(1, 2).reshape(n, -1, 1).double()
        b = w.offsets.reshape(g, w.planes, -1, 8)[:, p].transpose(1, 2).reshape(n, -1, 1).double()
        held = held + (codes.double() * s + b).reshape(n, -1)
    return held


@pytest.mark.parametrize("t", [T.Q6_K, T.Q3_K, T.Q2_K], ids=lambda t: t.name)
def test_sixteen_value_groups_become_one_byte_plane_within_a_510th_of_their_range(t):
    raw = sixteen_group_blocks(t, seed=7)
    exact = raw.dequantize()
    w = pack_int8_raw(raw)
    assert w.layout == P.BYTES and w.planes == 1
    groups = exact.reshape(exact.shape[0], -1, 32)
    span = (groups.amax(-1) - groups.amin(-1)).repeat_interleave(32, 1)
    # half a step (rounded to float16), and the float16 rounding of the group's offset
    offset = P.logical_scales(w)[1].double().repeat_interleave(32, 1).abs()
    bound = span.double() / 510 * (1 + 2.0**-10) + offset * 2.0**-11 + 1e-7
    assert ((_held(w) - exact.double()).abs() <= bound).all()


def test_a_constant_group_is_held_exactly():
    w = torch.full((8, 64), 0.25)
    w[1, 32:] = -3.0
    assert torch.allclose(_held(quantize_int8(w)), w.double(), atol=1e-6)


@needs_kernel
def test_a_weight_whose_inputs_are_not_whole_pairs_of_blocks_is_left_to_torchs_kernel():
    raw = random_blocks(T.Q4_0, seed=8)
    assert pack_int8_raw(raw) is not None
    odd = type(raw)(raw.data[:, : (K - 32) // 32 * 18], T.Q4_0, (raw.shape[0], K - 32))
    assert not P.fits(K - 32) and pack_int8_raw(odd) is None
    uneven = type(raw)(raw.data[:-4], T.Q4_0, (raw.shape[0] - 4, K))  # not whole groups of 8 outputs
    assert not P.fits_outputs(raw.shape[0] - 4) and pack_int8_raw(uneven) is None


@needs_kernel
def test_a_quantized_weight_on_the_kernel_multiplies_any_float_input():
    raw = random_blocks(T.Q4_K, seed=9)
    qw = QuantizedWeight(pack_int8_raw(raw), raw.shape[0], raw.shape[1], torch.float32)
    x = torch.randn(2, 3, raw.shape[1])
    want = x @ raw.dequantize().t()
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        got = int4_linear(x.to(dtype), qw)
        assert got.shape == (2, 3, raw.shape[0]) and got.dtype == dtype
        assert ((got.float() - want).norm() / want.norm()) < 0.02


def test_where_the_kernel_cannot_run_it_says_why_and_is_never_a_candidate(monkeypatch,
                                                                         embedded_model_path):
    from app.engine import device, kernel_policy
    from app.engine.kernel_policy import ModelShapes

    monkeypatch.setattr(P, "_kernel", None)
    monkeypatch.setattr(P, "_kernel_error", None)
    monkeypatch.setattr(P, "_target_isa", lambda: None)
    assert not P.available()
    assert "no kernel for this CPU" in P.unavailable_reason()
    with pytest.raises(RuntimeError, match="not available"):
        P.matmul(torch.zeros(1, 64), _nibble_weight(8, 64, 1, 0))
    shapes = ModelShapes("tiny", layers={(64, 64): 1}, head=(64, 64),
                         int4_layers={(64, 64, 1): 1}, head_planes=1)
    assert kernel_policy.INT8_KIND not in kernel_policy._allowed(shapes)
    with pytest.raises(device.DeviceError, match="int4_i8 needs the 8-bit activation kernel"):
        device.plan_load(embedded_model_path, torch.device("cpu"), "int4_i8", measure=False)


@needs_kernel
def test_the_kernel_follows_torchs_instruction_set():
    """A run held to torch's AVX2 kernels (ATEN_CPU_CAPABILITY=avx2) compiles for AVX2 too."""
    want = "AVX2" if torch.backends.cpu.get_cpu_capability() == "AVX2" else "AVX512"
    assert P.kernel().isa.removesuffix("-VNNI") == want
    assert want == "AVX512" or not P.kernel().isa.endswith("VNNI")


@needs_kernel
def test_joined_weights_multiply_like_their_parts_and_layouts_stay_apart():
    from app.models.layers import fuse

    parts = [QuantizedWeight(_nibble_weight(n, 128, 1, seed), n, 128, torch.float32)
             for n, seed in ((64, 10), (32, 11))]
    joined, views = fuse(parts, transposed=False)
    x = torch.randn(3, 128)
    assert torch.equal(int4_linear(x, joined),
                       torch.cat([int4_linear(x, p) for p in parts], dim=-1))
    for view, part in zip(views, parts):
        assert torch.equal(int4_linear(x, view), int4_linear(x, part))
    other = QuantizedWeight(_byte_weight(32, 128, 12), 32, 128, torch.float32)
    assert fuse([parts[0], other], transposed=False) is None


@needs_kernel
def test_five_bit_codes_are_byte_codes_in_fewer_bytes_and_join_them_as_bytes():
    """The same codes as FIVES and as BYTES: the same products bit for bit; a 5-bit weight
    joining a byte one (Gemma 3's Q5_0 Q and K beside a Q8_0 V) joins as bytes."""
    from app.models.layers import fuse

    five = _five_weight(40, 256, 13)
    assert five.codes.shape == (40, 256 // 64 * 40)  # 5.5 bits a code (BYTES: 8)
    as_bytes = P.as_bytes(five)
    assert as_bytes.layout == P.BYTES and torch.equal(_held(as_bytes), _held(five))
    for rows in (1, 3, 4, 6):
        x = torch.randn(rows, 256)
        assert torch.equal(P.matmul(x, five), P.matmul(x, as_bytes))
    parts = [QuantizedWeight(five, 40, 256, torch.float32),
             QuantizedWeight(_byte_weight(32, 256, 14), 32, 256, torch.float32)]
    joined, views = fuse(parts, transposed=False)
    assert joined.codes.layout == P.BYTES and all(v.codes.layout == P.BYTES for v in views)
    x = torch.randn(2, 256)
    assert torch.equal(int4_linear(x, joined), torch.cat([int4_linear(x, p) for p in parts], dim=-1))


@needs_kernel
def test_the_compiled_kernel_is_kept_and_a_damaged_copy_is_compiled_again(monkeypatch, tmp_path):
    import llvmlite.binding as llvm

    from app.paths import data_dir

    monkeypatch.setenv("FERROX_DATA_DIR", str(tmp_path))
    monkeypatch.delenv(P.OBJECT_CACHE_ENV, raising=False)  # (the suite's shared folder: conftest.py)

    def fresh() -> P._Kernel:
        monkeypatch.setattr(P, "_kernel", None)
        monkeypatch.setattr(P, "_kernel_error", None)
        return P.kernel()

    w, x = WEIGHTS["nibbles"](), torch.randn(3, 640)
    want = P.matmul(x, w)
    monkeypatch.setattr(P, "_kernel", None)
    monkeypatch.setattr(P, "_kernel_error", None)
    assert not P.ready()  # nothing saved in this data folder: only a compile would do
    assert P._kernel is None and P._kernel_error is None  # (and `ready` did not compile)
    fresh()
    saved = list((data_dir() / P.OBJECT_CACHE_DIR).glob("*.o"))
    assert len(saved) == 1
    monkeypatch.setattr(P, "_kernel", None)
    assert P.ready()  # a later process: the saved code
    optimized = []
    builder = llvm.create_pass_builder
    monkeypatch.setattr(llvm, "create_pass_builder", lambda *a: optimized.append(1) or builder(*a))
    assert fresh() is not None and not optimized  # the saved code, not a compile
    assert torch.equal(P.matmul(x, w), want)
    saved[0].write_bytes(saved[0].read_bytes()[:-40] + b"torn" * 10)
    assert fresh() is not None and optimized  # compiled again, and saved again
    assert torch.equal(P.matmul(x, w), want)
    assert P._read_object(saved[0]) is not None
    monkeypatch.setenv(P.OBJECT_CACHE_ENV, str(tmp_path / "shared"))  # a folder of their own
    assert P._object_path("ir", "cpu", "", (1,)).parent == tmp_path / "shared"


@needs_kernel
def test_a_frozen_build_carries_its_kernel_and_a_first_start_uses_it(monkeypatch, tmp_path):
    """The double-click build carries the machine code its build compiled
    (`packaging/build.py`): a first start, its data folder empty, finds it there (`ready`)
    and loads it instead of compiling; nothing is written to the data folder for it."""
    import llvmlite.binding as llvm

    w, x = WEIGHTS["nibbles"](), torch.randn(3, 640)
    want = P.matmul(x, w)
    build = P._build_inputs()
    code = build.saved_code()  # (the suite's shared folder has it: this process compiled it)
    assert code is not None
    carried = tmp_path / "bundle" / P.OBJECT_CACHE_DIR
    carried.mkdir(parents=True)
    P._write_object(carried / build.name, code)
    monkeypatch.setenv(P.OBJECT_CACHE_ENV, str(tmp_path / "empty"))
    monkeypatch.setattr(P, "_kernel", None)
    monkeypatch.setattr(P, "_kernel_error", None)
    assert not P.ready()  # not a frozen build: only a compile would do
    monkeypatch.setattr(sys, "frozen", True, raising=False)
    monkeypatch.setattr(sys, "_MEIPASS", str(tmp_path / "bundle"), raising=False)
    assert P.ready()
    optimized = []
    builder = llvm.create_pass_builder
    monkeypatch.setattr(llvm, "create_pass_builder", lambda *a: optimized.append(1) or builder(*a))
    assert P.kernel() is not None and not optimized
    assert torch.equal(P.matmul(x, w), want)
    assert not (tmp_path / "empty").exists()


@needs_kernel
@pytest.mark.parametrize("name", WEIGHTS)
def test_with_a_norm_it_multiplies_the_rms_norm_of_x(name):
    """The pre-norm folded into the product (`matmul`'s `norm`): the product of
    x / sqrt(mean(x^2) + eps) * norm, rounded to 8 bits as any x. Its float32 sum of squares
    is not torch's, so a value on a rounding boundary may round the other way: the result
    is the reference's to a few of those steps, and bit for bit the same in any batch."""
    w = WEIGHTS[name]()
    k = w.scales.shape[1] // w.planes * 32  # (inputs: blocks of 32 a plane)
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(9, k, generator=gen) * 3
    norm = torch.rand(k, generator=gen) + 0.5
    got = P.matmul(x, w, norm, 1e-6)
    xd = x.double()
    normed = (xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.double()).float()
    want = P.reference(normed, w)
    assert (got.double() - want).abs().max() <= 2e-3 * want.abs().max()
    assert not torch.equal(got, P.matmul(x, w))  # (the norm was taken)
    parts = torch.cat([P.matmul(x[i:i + 2], w, norm, 1e-6) for i in range(0, 9, 2)])
    assert torch.equal(parts, got)


@needs_kernel
def test_shapes_that_do_not_fit_the_weight_are_refused_before_the_kernel_runs():
    w = WEIGHTS["bytes"]()
    with pytest.raises(ValueError):  # x narrower than the weight's inputs
        P.matmul(torch.randn(2, 576), w)
    with pytest.raises(ValueError):  # a norm weight of the wrong length
        P.matmul(torch.randn(2, 1536), w, torch.ones(576), 1e-6)
