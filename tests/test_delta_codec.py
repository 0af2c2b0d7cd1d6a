"""engine/delta_codec.py: exact forms, sizes and round trips of a message's delta."""

from __future__ import annotations

import pytest
import torch

from nemo_refit_reshard.engine.delta_codec import (
    BITMAP,
    DENSE,
    HEADER_BYTES,
    POSITIONS,
    Header,
    apply_patch,
    changed_counts,
    changed_mask,
    choose_form,
    encode,
    payload_bytes,
    position_width,
)


def _round_trip(base: torch.Tensor, cur: torch.Tensor, unit: int, form: int) -> torch.Tensor:
    """Encode ``cur`` against ``base`` in ``form``, patch a copy of ``base``; the payload."""
    mask = changed_mask(cur, base, unit)
    (count,) = changed_counts([mask])
    out = torch.empty(4 * cur.numel() + 16, dtype=torch.uint8)
    payload = encode(cur, mask, unit, form, out).clone()
    assert payload.numel() == payload_bytes(form, cur.numel(), unit, count)
    message = base.clone()
    apply_patch(message, payload, Header(form, 7, count, payload.numel()), unit)
    assert torch.equal(message, cur)
    return payload


def _bf16_bytes(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.bfloat16).view(torch.uint8)


@pytest.mark.parametrize("form", [DENSE, POSITIONS, BITMAP])
def test_every_pattern_round_trips_bit_exactly_in_every_form(form: int) -> None:
    g = torch.Generator().manual_seed(0)
    base = torch.randint(0, 256, (1030,), dtype=torch.uint8, generator=g)  # 515 bf16 units
    patterns = {
        "none": lambda u: None,
        "all": lambda u: u.add_(1),
        "first": lambda u: u[0, 0].bitwise_xor_(1),
        "last": lambda u: u[-1, 1].bitwise_xor_(128),
        "every other": lambda u: u[::2, 0].bitwise_xor_(3),
    }
    for change in patterns.values():
        cur = base.clone()
        change(cur.view(-1, 2))
        _round_trip(base, cur, 2, form)


def test_counts_at_zero_one_last_every_other_and_all() -> None:
    base = torch.zeros(512, dtype=torch.uint8)  # 256 bf16 units
    cur = base.clone()
    assert changed_counts([changed_mask(cur, base, 2)]) == [0]
    cur.view(-1, 2)[-1, 1] = 1  # the last unit's high byte
    assert changed_counts([changed_mask(cur, base, 2)]) == [1]
    cur.view(-1, 2)[::2, 0] = 9
    assert changed_counts([changed_mask(cur, base, 2)]) == [129]
    assert changed_counts([changed_mask(base + 1, base, 2)]) == [256]


def test_bits_not_floats_are_compared() -> None:
    """-0.0 == 0.0 and NaN != NaN as floats; as bits the first pair differs and two equal
    NaN payloads do not, while two different NaN payloads do."""
    nan = float("nan")
    base = _bf16_bytes([0.0, nan, nan, 1.0])
    cur = _bf16_bytes([-0.0, nan, nan, 1.0])
    cur.view(torch.int16)[2] ^= 1  # another NaN payload
    mask = changed_mask(cur, base, 2)
    assert mask.tolist() == [True, False, True, False]
    assert torch.equal(base.view(torch.bfloat16)[1:2].isnan(), torch.tensor([True]))
    _round_trip(base, cur, 2, POSITIONS)


def test_fp8_bytes_compare_as_bytes() -> None:
    base = torch.arange(300, dtype=torch.int64).to(torch.uint8)
    cur = base.clone()
    cur[299] ^= 0x80  # e4m3 +x -> -x
    mask = changed_mask(cur, base, 1)
    assert mask.nonzero().flatten().tolist() == [299]
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
    assert choose_form(2000, 2, 0) == POSITIONS  # nothing changed: an empty payload
    assert choose_form(2000, 2, 10) == POSITIONS
    assert choose_form(2000, 2, 100) == BITMAP  # 400 vs 325
    assert choose_form(2000, 2, 1000) == DENSE  # 4000 and 2125 vs 2000
    assert choose_form(2000, 2, 937) == BITMAP  # 1999 bytes
    assert choose_form(2000, 2, 938) == DENSE  # 2001 bytes


def test_bitmap_bits_are_little_endian_within_each_byte() -> None:
    base = torch.zeros(20, dtype=torch.uint8)  # 10 bf16 units
    cur = base.clone()
    cur.view(-1, 2)[0] = torch.tensor([1, 2], dtype=torch.uint8)
    cur.view(-1, 2)[9] = torch.tensor([3, 4], dtype=torch.uint8)
    payload = _round_trip(base, cur, 2, BITMAP)
    assert payload.tolist() == [0b00000001, 0b00000010, 1, 2, 3, 4]


def test_headers_are_32_bytes_and_refuse_garbage() -> None:
    raw = torch.empty(HEADER_BYTES, dtype=torch.uint8)
    Header(BITMAP, 5, 3, 9).write(raw)
    assert Header.read(raw) == Header(BITMAP, 5, 3, 9)
    raw.fill_(0xFF)
    with pytest.raises(ValueError, match="not a delta header"):
        Header.read(raw)
