"""verifier_svc.tap_buffer.TapRows: rows read back equal the concatenation of what was kept."""

import torch

from verifier_svc.tap_buffer import TapRows


def test_rows_equal_the_concatenation_across_growth_and_truncation():
    g = torch.Generator().manual_seed(0)
    taps, kept = TapRows(), []
    assert len(taps) == 0 and taps.rows(0).numel() == 0
    for m in (5, 1, 0, 70, 3, 200, 1):          # the 200-row append outgrows 5 + 256 rows
        chunk = torch.randn(m, 6, generator=g)
        taps.append(chunk)
        kept.append(chunk)
        full = torch.cat(kept)
        assert len(taps) == full.shape[0]
        for start in (0, 1, full.shape[0] // 2, full.shape[0]):
            assert torch.equal(taps.rows(start), full[start:])
    taps.truncate(40)                           # a reused prefix: later rows are replaced
    new = torch.randn(4, 6, generator=g)
    taps.append(new)
    assert torch.equal(taps.rows(0), torch.cat([full[:40], new]))
    taps.truncate(0)
    assert len(taps) == 0 and taps.rows(0).shape[0] == 0


def test_rows_are_not_copied_when_read():
    taps = TapRows()
    taps.append(torch.ones(3, 2))
    a, b = taps.rows(1), taps.rows(0)
    assert a.data_ptr() == b[1:].data_ptr()     # a view: reading the unsent rows copies nothing
