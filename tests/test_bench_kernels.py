"""The kernel benchmark's pieces that run without a GPU: the identity-table layout of the
paging tax (checked through the decode: NumPy here, the CUDA kernel on a GPU), and the tax's arithmetic and printed table on
made-up rows (no timing is measured or asserted here)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from pagedkv import backend
from pagedkv.bench import kernels as bk
from pagedkv.kernels import paged_decode_attention

SEED = 23

host = backend.to_numpy


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_identity_layout_holds_the_same_kv_and_gives_the_same_output(dtype):
    print(f"seed {SEED}")
    shape = dict(batch=6, seq_len="mixed", max_len=70, q_heads=8, kv_heads=2)
    lens = bk.shape_lengths(shape, SEED)
    q, cache, tables, dlens = bk.make_problem(lens, 8, 2, 64, 16, dtype, SEED)
    cache_c, tables_c = bk.contiguous_layout(cache, tables)
    out = host(paged_decode_attention(q, cache, tables, dlens))
    out_c = host(paged_decode_attention(q, cache_c, tables_c, dlens))
    assert np.array_equal(out, out_c)              # same numbers, same arithmetic
    cache, tables, cache_c, tables_c = map(host, (cache, tables, cache_c, tables_c))
    batch, nblocks = tables.shape
    pages = -(-lens // 16)
    assert tables_c.dtype == np.int32 and tables_c.shape == tables.shape
    for b in range(batch):
        assert tables_c[b].tolist() == [b * nblocks + i for i in range(nblocks)]
        for i in range(pages[b]):                  # each used block holds the same K and V
            assert np.array_equal(cache_c[tables_c[b, i]], cache[tables[b, i]])
    # the scattered table really is scattered, so the test compares two layouts
    assert any(tables[b, i + 1] != tables[b, i] + 1 for b in range(batch)
               for i in range(pages[b] - 1))


def _rows():
    """Two shapes with every column, a mixed batch without SDPA, a sweep point."""
    def r(impl, us, batch=64, seq=2048, qh=32, kh=8, dtype="float16", **kw):
        return dict(impl=impl, us=us, dtype=dtype, batch=batch, seq_len=seq, q_heads=qh,
                    kv_heads=kh, tbps=1.0, **kw)
    return [r("pagedkv", 110.0, path="cuda-cores"),
            r("pagedkv.identity_table", 105.0),
            r("sdpa_contiguous", 100.0),
            r("flashinfer", 121.0, path="tc"),
            r("pagedkv", 121.0, qh=64, path="tensor-cores"),
            r("pagedkv.identity_table", 110.0, qh=64),
            r("sdpa_contiguous", 100.0, qh=64),
            r("flashinfer", 108.9, qh=64, path="tc"),
            r("pagedkv", 300.0, seq="mixed", qh=64, path="tensor-cores"),
            r("pagedkv.identity_table", 290.0, seq="mixed", qh=64),
            r("flashinfer", 330.0, seq="mixed", qh=64, path="tc"),
            r("tax_sweep.pagedkv", 50.0, batch=16, seq=256),
            r("tax_sweep.pagedkv.identity_table", 50.0, batch=16, seq=256),
            r("tax_sweep.sdpa_contiguous", 40.0, batch=16, seq=256)]


def test_paging_tax_per_shape():
    cases = bk.paging_tax(_rows())
    assert list(cases) == [("float16", 64, 2048, 32, 8), ("float16", 64, 2048, 64, 8),
                           ("float16", 64, "mixed", 64, 8)]     # the sweep is apart
    c = cases[("float16", 64, 2048, 32, 8)]
    assert c["tax"] == pytest.approx(0.10)
    assert c["indirection"] == pytest.approx(110 / 105 - 1)
    assert c["rest"] == pytest.approx(0.05)
    assert c["fi_over_ours"] == pytest.approx(1.1)
    mixed = cases[("float16", 64, "mixed", 64, 8)]
    assert mixed["tax"] is None and mixed["rest"] is None       # SDPA: equal lengths only
    assert mixed["indirection"] == pytest.approx(300 / 290 - 1)
    sweep = bk.paging_tax(_rows(), "tax_sweep.")
    assert list(sweep) == [("float16", 16, 256, 32, 8)]
    assert sweep[("float16", 16, 256, 32, 8)]["tax"] == pytest.approx(0.25)


def test_tax_goals_geometric_means_and_groups():
    g = bk.tax_goals(bk.paging_tax(_rows()))
    assert g["tax_cases"] == 2 and g["indirection_cases"] == 3
    assert g["geomean_tax"] == pytest.approx(math.sqrt(1.10 * 1.21) - 1)
    assert g["geomean_indirection"] == pytest.approx(
        (110 / 105 * 121 / 110 * 300 / 290) ** (1 / 3) - 1)
    assert g["geomean_rest"] == pytest.approx(math.sqrt(1.05 * 1.10) - 1)
    assert g["tax_goal_met"] is False                           # 15 % > 3 %
    by = g["flashinfer_over_pagedkv_by_group"]
    assert list(by) == [4, 8]
    assert by[4] == pytest.approx(1.1)
    assert by[8] == pytest.approx(math.sqrt(0.9 * 1.1))
    assert g["ahead_of_flashinfer_every_group"] is False       # group 8: 0.995
    fast = [dict(r, us=r["us"] * 0.5) if r["impl"] == "pagedkv" else r for r in _rows()]
    g2 = bk.tax_goals(bk.paging_tax(fast))
    assert g2["tax_goal_met"] is True and g2["ahead_of_flashinfer_every_group"] is True


def test_summary_prints_the_tax_columns_and_the_sweep():
    lines = []
    res = bk.summary(_rows(), lines.append)
    text = "\n".join(lines)
    assert "ident us" in text and "tax" in text and "scatter" in text
    assert " +10.0%" in text and "  +4.8%" in text              # the 32/8 row
    assert "paging tax (ours / SDPA on contiguous K/V - 1), geometric mean: +15.4%" in text
    assert "(goal 3%: not met)" in text
    assert "length sweep (1 points): 32/8 L256: tax +25.0%, scatter +0.0%" in text
    assert res["cases"] == 3 and res["paging_tax"]["tax_cases"] == 2
    assert res["tax_sweep"][0]["seq_len"] == 256 and res["tax_sweep"][0]["tax"] == 0.25
