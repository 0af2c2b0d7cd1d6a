"""engine/delta/codec.py: exact forms, sizes and round trips of a message's delta."""

from __future__ import annotations

import pytest
import torch

from nemo_refit_reshard.engine.delta.codec import (
    BITMAP,
    DENSE,
    GAPS,
    HEADER_BYTES,
    POSITIONS,
    Header,
    apply_patch,
    changed_units,
    choose_form,
    count_long_gaps,
    encode,
    payload_bytes,
    payload_values,
    position_width,
    take_units,
    with_ranges,
)


def _round_trip(base: torch.Tensor, cur: torch.Tensor, unit: int, form: int) -> torch.Tensor:
    """Encode ``cur`` against ``base`` in ``form``, patch a copy of ``base``; the payload."""
    index = changed_units(cur, base, unit)
    count = index.numel()
    out = torch.empty(4 * cur.numel() + 16, dtype=torch.uint8)
    payload = encode(cur, index, unit, form, out).clone()
    long_gaps = count_long_gaps(index)
    assert payload.numel() == payload_bytes(form, cur.numel(), unit, count, long_gaps)
    values = payload_values(payload, form, cur.numel(), unit, count)
    expected = cur if form == DENSE else take_units(cur, index, unit)
    assert torch.equal(values, expected)  # the changed units, found inside the payload
    message = base.clone()
    apply_patch(message, payload, Header(form, 7, count, payload.numel()), unit)
    assert torch.equal(message, cur)
    return payload


def _bf16_bytes(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.bfloat16).view(torch.uint8)


@pytest.mark.parametrize("form", [DENSE, POSITIONS, BITMAP, GAPS])
def test_every_pattern_round_trips_bit_exactly_in_every_form(form: int) -> None:
    g = torch.Generator().manual_seed(0)
    base = torch.randint(0, 256, (1030,), dtype=torch.uint8, generator=g)  # 515 bf16 units
    patterns = {
        "none": lambda u: None,
        "all": lambda u: u.add_(1),
        "first": lambda u: u[0, 0].bitwise_xor_(1),
        "last": lambda u: u[-1, 1].bitwise_xor_(128),
        "every other": lambda u: u[::2, 0].bitwise_xor_(3),
        "far apart": lambda u: u[[3, 300, 301, 514], 1].bitwise_xor_(1),  # long gaps
    }
    for change in patterns.values():
        cur = base.clone()
        change(cur.view(-1, 2))
        _round_trip(base, cur, 2, form)


def test_counts_at_zero_one_last_every_other_and_all() -> None:
    base = torch.zeros(512, dtype=torch.uint8)  # 256 bf16 units
    cur = base.clone()
    assert changed_units(cur, base, 2).tolist() == []
    cur.view(-1, 2)[-1, 1] = 1  # the last unit's high byte
    assert changed_units(cur, base, 2).tolist() == [255]
    cur.view(-1, 2)[::2, 0] = 9
    assert changed_units(cur, base, 2).tolist() == [*range(0, 256, 2), 255]
    assert changed_units(base + 1, base, 2).tolist() == list(range(256))


def test_bits_not_floats_are_compared() -> None:
    """-0.0 == 0.0 and NaN != NaN as floats; as bits the first pair differs and two equal
    NaN payloads do not, while two different NaN payloads do."""
    nan = float("nan")
    base = _bf16_bytes([0.0, nan, nan, 1.0])
    cur = _bf16_bytes([-0.0, nan, nan, 1.0])
    cur.view(torch.int16)[2] ^= 1  # another NaN payload
    assert changed_units(cur, base, 2).tolist() == [0, 2]
    assert torch.equal(base.view(torch.bfloat16)[1:2].isnan(), torch.tensor([True]))
    _round_trip(base, cur, 2, POSITIONS)


def test_fp8_bytes_compare_as_bytes() -> None:
    base = torch.arange(300, dtype=torch.int64).to(torch.uint8)
    cur = base.clone()
    cur[299] ^= 0x80  # e4m3 +x -> -x
    assert changed_units(cur, base, 1).tolist() == [299]
    payload = _round_trip(base, cur, 1, POSITIONS)
    # 300 units need 2-byte positions: index 299 = 0x012B little-endian, then the byte
    assert payload.tolist() == [0x2B, 0x01, int(cur[299])]


def test_position_widths_switch_at_256_and_65536_units() -> None:
    assert [position_width(n) for n in (1, 256, 257, 65536, 65537)] == [1, 1, 2, 2, 4]


def test_payload_sizes_and_the_chosen_form() -> None:
    # 1000 bf16 units (2000 bytes): positions 2+2 per change, bitmap 125 + 2 per change
    assert payload_bytes(DENSE, 2000, 2, 10) == 2000
    assert payload_bytes(POSITIONS, 2000, 2, 10) == 40
    assert payload_bytes(BITMAP, 2000, 2, 10) == 145
    assert payload_bytes(GAPS, 2000, 2, 10) == 30
    assert payload_bytes(GAPS, 2000, 2, 10, long_gaps=3) == 42
    assert choose_form(2000, 2, 0) == POSITIONS  # nothing changed: an empty payload
    assert choose_form(2000, 2, 10) == GAPS  # 30 vs 40
    assert choose_form(2000, 2, 10, long_gaps=3) == POSITIONS  # 42 vs 40
    assert choose_form(2000, 2, 10, long_gaps=2) == GAPS  # 38 vs 40
    assert choose_form(2000, 2, 100) == GAPS  # 300 vs 400 and 325
    assert choose_form(2000, 2, 400, long_gaps=0) == BITMAP  # 925 vs 1200
    assert choose_form(2000, 2, 1000) == DENSE  # 4000, 2125 and 3000 vs 2000
    assert choose_form(2000, 2, 937) == BITMAP  # 1999 bytes
    assert choose_form(2000, 2, 938) == DENSE  # 2001 bytes


def test_gaps_are_one_byte_up_to_255_then_four_bytes_after_the_units() -> None:
    """Units 254 (gap 255 from -1: one byte), 255 (gap 1) and 600 (gap 345: a 0 byte,
    then 345 as uint32 after the gap bytes); the values come first."""
    base = torch.zeros(2 * 700, dtype=torch.uint8)  # 700 bf16 units
    cur = base.clone()
    for unit, value in ((254, 5), (255, 6), (600, 7)):
        cur.view(-1, 2)[unit, 0] = value
    index = changed_units(cur, base, 2)
    assert index.tolist() == [254, 255, 600] and count_long_gaps(index) == 1
    payload = _round_trip(base, cur, 2, GAPS)
    assert payload.tolist() == [5, 0, 6, 0, 7, 0, 255, 1, 0, 345 % 256, 345 // 256, 0, 0]


def test_the_gpu_gap_code_gives_the_numpy_bytes_on_cpu_tensors() -> None:
    """The torch ops the GPU path runs, on CPU tensors: the same gap bytes and indices."""
    from nemo_refit_reshard.engine.delta.codec import _gaps, _gaps_torch, _ungap, _ungap_torch

    index = torch.tensor([0, 1, 255, 256, 70_000, 70_255, 4_000_000_000])
    short, wide = _gaps(index)
    assert short.tolist() == [1, 1, 254, 1, 0, 255, 0]
    assert wide.numpy().view("<u4").tolist() == [70_000 - 256, 4_000_000_000 - 70_255]
    t_short, t_wide = _gaps_torch(index)
    assert torch.equal(t_short, short) and torch.equal(t_wide, wide)
    payload = torch.cat([short, wide])
    assert _ungap(payload, 7).tolist() == index.tolist()
    assert _ungap_torch(payload, 7).tolist() == index.tolist()


def test_a_gaps_payload_that_disagrees_with_its_header_is_refused() -> None:
    """Gaps past the message's end, or a payload of another length than its gap bytes
    say, raise before anything is written."""
    from nemo_refit_reshard.engine.delta.codec import decode

    values = torch.tensor([5, 0, 6, 0], dtype=torch.uint8)  # two bf16 units
    past_end = torch.cat([values, torch.tensor([200, 100], dtype=torch.uint8)])
    with pytest.raises(ValueError, match="gaps reach unit 299 of a 256-unit message"):
        decode(past_end, Header(GAPS, 0, 2, 6), 512, 2)
    missing_long = torch.cat([values, torch.tensor([1, 0], dtype=torch.uint8)])
    with pytest.raises(ValueError, match="has 2 gap bytes, not 6"):
        decode(missing_long, Header(GAPS, 0, 2, 6), 512, 2)


def test_a_first_change_past_255_units_is_a_long_gap() -> None:
    assert count_long_gaps(torch.tensor([254, 600])) == 1  # only 600 - 254
    assert count_long_gaps(torch.tensor([255])) == 1  # 256 from -1
    assert count_long_gaps(torch.tensor([], dtype=torch.int64)) == 0


def test_bitmap_bits_are_little_endian_within_each_byte() -> None:
    base = torch.zeros(20, dtype=torch.uint8)  # 10 bf16 units
    cur = base.clone()
    cur.view(-1, 2)[0] = torch.tensor([1, 2], dtype=torch.uint8)
    cur.view(-1, 2)[9] = torch.tensor([3, 4], dtype=torch.uint8)
    payload = _round_trip(base, cur, 2, BITMAP)
    assert payload.tolist() == [0b00000001, 0b00000010, 1, 2, 3, 4]


def test_fixed_ranges_join_the_changed_units() -> None:
    index = torch.tensor([1, 9], dtype=torch.int64)
    assert with_ranges(index, [(4, 10), (12, 13)], 2).tolist() == [1, 2, 3, 4, 6, 9]
    assert with_ranges(index, [], 2) is index


def test_a_strided_live_run_takes_exactly_its_changed_elements() -> None:
    """A run into a column slice of a live tensor (as a TP shard's rows of a wider
    tensor): the delta writes the changed elements in place and nothing else."""
    from nemo_refit_reshard.engine.delta.rounds import DIRECT, Incoming, RunIn, place

    whole = torch.full((4, 6), 7.0, dtype=torch.bfloat16)
    live = whole[:, 1:4]  # 4 x 3, strided
    span = torch.zeros(24, dtype=torch.uint8)
    run = RunIn(0, 12, span.view(torch.bfloat16).view(4, 3), live, DIRECT)
    new = torch.tensor([-0.0, 2.5], dtype=torch.bfloat16)
    place(Incoming(0, span, 2, [run]), torch.tensor([4, 11]), new.view(torch.uint8))
    expected = torch.full((4, 6), 7.0, dtype=torch.bfloat16)
    expected[1, 2], expected[3, 3] = -0.0, 2.5
    assert torch.equal(whole.view(torch.int16), expected.view(torch.int16))
    assert torch.equal(span, torch.zeros(24, dtype=torch.uint8))  # no staging touched


def test_headers_are_32_bytes_and_refuse_garbage() -> None:
    raw = torch.empty(HEADER_BYTES, dtype=torch.uint8)
    Header(BITMAP, 5, 3, 9).write(raw)
    assert Header.read(raw) == Header(BITMAP, 5, 3, 9)
    raw.fill_(0xFF)
    with pytest.raises(ValueError, match="not a delta header"):
        Header.read(raw)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("form", [POSITIONS, BITMAP, GAPS])
def test_the_cuda_path_gives_the_cpu_paths_bytes(form: int) -> None:
    """The torch ops a GPU runs give byte for byte the payload the numpy path gives, and
    patch a message back to the same bytes; scatters into strided live views too."""
    from nemo_refit_reshard.engine.delta.rounds import DIRECT, Incoming, RunIn, place

    g = torch.Generator().manual_seed(1)
    base = torch.randint(0, 256, (2 * 4096,), dtype=torch.uint8, generator=g)
    cur = base.clone()
    cur.view(torch.int16)[::37] += 1
    cur[2000:3200] = base[2000:3200]  # a gap of more than 255 units
    cpu = _round_trip(base, cur, 2, form)
    cuda = torch.device("cuda")
    index = changed_units(cur.to(cuda), base.to(cuda), 2)
    assert index.cpu().tolist() == changed_units(cur, base, 2).tolist()
    out = torch.empty(cur.numel(), dtype=torch.uint8, device=cuda)
    assert torch.equal(encode(cur.to(cuda), index, 2, form, out).cpu(), cpu)
    live = torch.zeros(64, 128, dtype=torch.bfloat16, device=cuda)[:, :64]  # strided
    live.copy_(base.view(torch.bfloat16).view(64, 64).to(cuda))
    span = torch.empty(base.numel(), dtype=torch.uint8, device=cuda)
    run = RunIn(0, 4096, span.view(torch.bfloat16).view(64, 64), live, DIRECT)
    idx, values = index, take_units(cur.to(cuda), index, 2)
    place(Incoming(0, span, 2, [run]), idx, values)
    assert torch.equal(live.cpu().contiguous().view(torch.uint8).view(-1), cur)
