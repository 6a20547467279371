"""The H200 operand layouts (gbs.layouts): word order, tiled boxes, fused box + scale chunks, UE4M3 H200 codes."""
import ml_dtypes
import numpy as np
import pytest

from gbs.formats import decode_ue4m3
from gbs.layouts import E2M1H200FusedOrder, E2M1H200Order, E2M1H200TiledOrder, UE4M3H200Scales


def test_ue4m3_h200_codes_give_the_kernels_bf16_scale_exactly():
    """Every UE4M3 byte: the code's bf16 (``(code << 4) + (235 << 7)``, what the H200 kernels compute) is
    ``s * 2**118`` exactly, zero is -0 (it still zeroes its block), NaN stays NaN; no code reaches the sign
    bit or the next 16-bit lane; ``decode`` undoes ``encode``; the codes are distinct."""
    u = np.arange(128, dtype=np.uint8)
    codes = UE4M3H200Scales.encode(u)
    assert codes.dtype == np.uint8 and len(set(codes.tolist())) == 128
    wide = (codes.astype(np.uint32) << np.uint32(UE4M3H200Scales.CODE_SHIFT)) + np.uint32(UE4M3H200Scales.EXPONENT_BASE << 7)
    assert wide.max() <= 0x8000 and (wide >= 0x8000).sum() == 1   # only zero's code reaches bit 15: -0
    bits = UE4M3H200Scales.bf16_bits(codes)
    got = bits.view(ml_dtypes.bfloat16).astype(np.float64)
    want = decode_ue4m3(u).astype(np.float64) * 2.0 ** UE4M3H200Scales.LOG2_MULTIPLIER
    finite = np.isfinite(want)
    np.testing.assert_array_equal(got[finite], want[finite])
    assert np.isnan(got[0x7F]) and bits[0x7F] == 0x7FC0 and bits[0] == 0x8000
    assert codes[0] == UE4M3H200Scales.ZERO_BYTE and codes[0x7F] == UE4M3H200Scales.NAN_BYTE
    np.testing.assert_array_equal(UE4M3H200Scales.decode(codes), u)
    shaped = np.random.default_rng(3).integers(0, 128, (2, 3, 32, 4, 4), dtype=np.uint8)
    np.testing.assert_array_equal(UE4M3H200Scales.decode(UE4M3H200Scales.encode(shaped)), shaped)


def test_ue4m3_h200_codes_refuse_what_is_not_a_scale():
    with pytest.raises(ValueError, match=r"UE4M3 scale byte 0x80 at \(1, 2\) has the sign bit set"):
        UE4M3H200Scales.encode(np.array([[1, 2, 3], [4, 5, 0x80]], np.uint8))
    with pytest.raises(ValueError, match=r"byte 0x01 at \(0,\) is not a UE4M3H200Scales code"):
        UE4M3H200Scales.decode(np.array([1, 8], np.uint8))
    with pytest.raises(TypeError, match="block-scale bytes must be uint8"):
        UE4M3H200Scales.encode(np.zeros(4, np.int16))
    with pytest.raises(ValueError, match="scale_dtype must be"):
        E2M1H200Order.encode_scales(np.zeros(4, np.uint8), "e8m0")


def test_h200_order_keeps_ue8m0_scales_and_codes_ue4m3_ones():
    scales = np.random.default_rng(4).integers(0, 128, (3, 1, 32, 4, 4), dtype=np.uint8)
    for encode in (E2M1H200Order.encode_scales, E2M1H200Order.decode_scales):
        same = encode(scales, "ue8m0")
        np.testing.assert_array_equal(same, scales)
        assert same is not scales   # a copy, as the UE4M3 path returns a new array
    coded = E2M1H200Order.encode_scales(scales, "ue4m3")
    np.testing.assert_array_equal(coded, UE4M3H200Scales.encode(scales))
    np.testing.assert_array_equal(E2M1H200Order.decode_scales(coded, "ue4m3"), scales)


def test_tiled_h200_order_stores_each_box_contiguously():
    """``E2M1H200TiledOrder``: the words of ``E2M1H200Order``, each 128-row x 128-byte box of an expert's
    (N, K/2) matrix contiguous, boxes in (row tile, K box) order, where the docstring's formula says;
    shape kept; ``unswizzle`` undoes ``swizzle`` and ``untile`` ``tile``."""
    rng = np.random.default_rng(11)
    packed = rng.integers(0, 256, (3, 384, 640), dtype=np.uint8)   # 3 row tiles x 5 K boxes per expert
    tiled = E2M1H200TiledOrder.swizzle(packed)
    assert tiled.shape == packed.shape and tiled.dtype == np.uint8
    np.testing.assert_array_equal(tiled, E2M1H200TiledOrder.tile(E2M1H200Order.swizzle(packed)))
    np.testing.assert_array_equal(E2M1H200TiledOrder.unswizzle(tiled), packed)
    ordered = E2M1H200Order.swizzle(packed)
    slabs = tiled.reshape(3, -1)
    k_boxes = 640 // 128
    for expert, row, col in zip(rng.integers(0, 3, 500), rng.integers(0, 384, 500), rng.integers(0, 640, 500)):
        box_row = (row // 128 * k_boxes + col // 128) * 128 + row % 128
        assert slabs[expert, box_row * 128 + col % 128] == ordered[expert, row, col]
    box = tiled.reshape(3, -1)[1, (1 * k_boxes + 2) * 16384:][:16384].reshape(128, 128)
    np.testing.assert_array_equal(box, ordered[1, 128:256, 256:384])   # row tile 1, K box 2: one 16 KB run
    np.testing.assert_array_equal(E2M1H200TiledOrder.untile(E2M1H200TiledOrder.tile(packed[0])), packed[0])
    assert E2M1H200TiledOrder.ROLES == ("weights",) and E2M1H200TiledOrder.TILED
    assert E2M1H200TiledOrder.WORD_ORDER == E2M1H200Order.WORD_ORDER


@pytest.mark.parametrize("shape", [(3, 384, 600), (3, 200, 640), (2, 200, 88)])
def test_tiled_h200_order_pads_to_whole_boxes_with_zeros(shape):
    """N and K/2 that are not whole boxes (gpt-oss: N = K = 2880) are stored padded to them with zero bytes (E2M1
    zeros); ``unswizzle`` given the logical shape cuts the pad off and inverts ``swizzle``; without it, or with
    another shape, a stored array that is not whole boxes is refused."""
    rng = np.random.default_rng(13)
    packed = rng.integers(0, 256, shape, dtype=np.uint8)
    tiled = E2M1H200TiledOrder.swizzle(packed)
    padded = E2M1H200TiledOrder.padded_shape(shape)
    assert tiled.shape == padded == (*shape[:-2], -(-shape[-2] // 128) * 128, -(-shape[-1] // 128) * 128)
    rows = E2M1H200TiledOrder.untile(tiled)   # stored rows, pad included
    assert not rows[..., shape[-2]:, :].any() and not rows[..., shape[-1]:].any()
    np.testing.assert_array_equal(rows[..., :shape[-2], :shape[-1]], E2M1H200Order.swizzle(packed))
    np.testing.assert_array_equal(E2M1H200TiledOrder.unswizzle(tiled, shape), packed)
    with pytest.raises(ValueError, match="do not store weights of shape"):
        E2M1H200TiledOrder.unswizzle(tiled, (*shape[:-1], shape[-1] + 128))
    with pytest.raises(ValueError, match="boxes of 128 rows x 128 bytes"):
        E2M1H200TiledOrder.unswizzle(packed)


def test_tiled_h200_order_needs_rows_of_bytes():
    with pytest.raises(ValueError, match="tile takes"):
        E2M1H200TiledOrder.swizzle(np.zeros((640,), np.uint8))


@pytest.mark.parametrize("block_size", [16, 32])
def test_fused_h200_order_pads_n_k_and_the_last_slice_s_atoms(block_size):
    """Fused weights of N = 200, K = 352 (neither whole): chunks of the padded (256, 512) weights, the atoms of
    the padded K columns zero; ``unfuse`` / ``scale_atoms`` given K return the logical atoms."""
    rng = np.random.default_rng(14)
    n, k = 200, 352
    tiled = E2M1H200TiledOrder.swizzle(rng.integers(0, 256, (2, n, k // 2), dtype=np.uint8))
    cols = -(-(k // block_size) // 4)
    atoms = rng.integers(0, 256, (2, 2, cols, 32, 4, 4), dtype=np.uint8)
    fused = E2M1H200FusedOrder.fuse(tiled, atoms, block_size)
    assert fused.shape == (2, 256, 256 + 512 // block_size)
    assert E2M1H200FusedOrder.stored_row_bytes(k, block_size) == fused.shape[-1]
    stored = E2M1H200FusedOrder.scale_atoms(fused, block_size)
    assert stored.shape[2] == 512 // block_size // 4 and not stored[:, :, cols:].any()
    np.testing.assert_array_equal(E2M1H200FusedOrder.scale_atoms(fused, block_size, k), atoms)
    back, back_atoms = E2M1H200FusedOrder.unfuse(fused, block_size, k)
    np.testing.assert_array_equal(back, tiled)
    np.testing.assert_array_equal(back_atoms, atoms)
    with pytest.raises(ValueError, match="do not store K=600"):
        E2M1H200FusedOrder.scale_atoms(fused, block_size, 600)


@pytest.mark.parametrize("block_size", [16, 32])
def test_fused_h200_order_puts_each_box_s_scale_atoms_behind_it(block_size):
    """``E2M1H200FusedOrder``: chunk (row tile t, K box s) of an expert is the tiled box (t, s), 16 KB, then the
    atoms of K slice s of band t, 128 x 256 / block_size bytes, exactly as ``b_scales`` holds them; the shape is
    (..., N, K/2 + K/block_size); ``unfuse`` and ``scale_atoms`` undo ``fuse``."""
    rng = np.random.default_rng(12)
    experts, n, kb = 3, 384, 640   # 3 row tiles x 5 K boxes
    k = 2 * kb
    tiled = E2M1H200TiledOrder.swizzle(rng.integers(0, 256, (experts, n, kb), dtype=np.uint8))
    atoms = rng.integers(0, 256, (experts, n // 128, k // block_size // 4, 32, 4, 4), dtype=np.uint8)
    fused = E2M1H200FusedOrder.fuse(tiled, atoms, block_size)
    scale_bytes = E2M1H200FusedOrder.chunk_scale_bytes(block_size)
    assert scale_bytes == {16: 2048, 32: 1024}[block_size]
    assert fused.shape == (experts, n, kb + k // block_size) == (experts, n, E2M1H200FusedOrder.stored_row_bytes(
        k, block_size))
    chunk = 16384 + scale_bytes
    per_slice = atoms.reshape(experts, n // 128, kb // 128, scale_bytes)   # each K slice's atoms, contiguous
    for expert, t, s in ((0, 0, 0), (2, 1, 3), (1, 2, 4)):
        start = ((expert * (n // 128) + t) * (kb // 128) + s) * chunk
        run = fused.reshape(-1)[start:start + chunk]
        np.testing.assert_array_equal(run[:16384], tiled.reshape(experts, -1)[expert, (t * 5 + s) * 16384:][:16384])
        np.testing.assert_array_equal(run[16384:], per_slice[expert, t, s])
    back, back_atoms = E2M1H200FusedOrder.unfuse(fused, block_size)
    np.testing.assert_array_equal(back, tiled)
    np.testing.assert_array_equal(back_atoms, atoms)
    np.testing.assert_array_equal(E2M1H200FusedOrder.scale_atoms(fused, block_size), atoms)
    assert E2M1H200FusedOrder.ROLES == ("weights",) and E2M1H200FusedOrder.TILED


def test_fused_h200_order_refuses_what_it_cannot_hold():
    tiled = np.zeros((2, 256, 256), np.uint8)
    atoms = np.zeros((2, 2, 8, 32, 4, 4), np.uint8)   # NVFP4: 512 elements / 16 / 4
    with pytest.raises(ValueError, match=r"scale atoms must be uint8 \(2, 2, 4, 32, 4, 4\) \(or fewer"):
        E2M1H200FusedOrder.fuse(tiled, atoms, 32)
    with pytest.raises(ValueError, match="boxes of 128 rows x 128 bytes"):
        E2M1H200FusedOrder.fuse(np.zeros((2, 200, 256), np.uint8), atoms, 16)
    fused = E2M1H200FusedOrder.fuse(tiled, atoms, 16)
    with pytest.raises(ValueError, match=r"needs \(\.\.\., N, K/2 \+ K/32\) bytes"):
        E2M1H200FusedOrder.unfuse(fused, 32)   # NVFP4 chunks read as MXFP4: not whole chunks
    with pytest.raises(ValueError, match="needs"):
        E2M1H200FusedOrder.check_shape(fused.shape[:-1] + (fused.shape[-1] - 16,), "nvfp4")
    E2M1H200FusedOrder.check_shape(fused.shape, "nvfp4")
    with pytest.raises(TypeError, match="holds the weights' scales too"):
        E2M1H200FusedOrder.unswizzle(fused)
