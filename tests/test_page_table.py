import numpy as np
import pytest

from pagedkv.errors import ConfigError, TokenIndexError
from pagedkv.page_table import PageTable, slots_of


def test_scattered_mapping():
    pt = PageTable(4, blocks=[7, 2, 9], num_tokens=10)
    assert pt.num_blocks == 3 and pt.capacity == 12 and len(pt) == 10
    assert pt.locate(0) == (7, 0)
    assert pt.locate(5) == (2, 1)
    assert pt.locate(9) == (9, 1)
    assert pt.slot(5) == 2 * 4 + 1
    # token 5: logical block 1 (physical 2), offset 1; blocks of 4 K rows then 4 V rows of 16 B
    assert pt.kv_addresses(5, pool_base=1000, row_bytes=16) == (1000 + (2 * 2 * 4 + 1) * 16,
                                                                1000 + (2 * 2 * 4 + 5) * 16)
    assert pt.slots().tolist() == [pt.slot(t) for t in range(10)]
    assert pt.slots().dtype == np.int32


def test_append_token_and_block():
    pt = PageTable(2)
    with pytest.raises(TokenIndexError, match="no room"):
        pt.append_token()
    pt.append_block(5)
    assert pt.append_token() == 10 and pt.append_token() == 11
    with pytest.raises(TokenIndexError):
        pt.append_token()
    pt.append_block(0)
    assert pt.append_token() == 0


@pytest.mark.parametrize("token", [-1, 10, 100, 2.0, "3", True])
def test_token_out_of_range(token):
    pt = PageTable(4, blocks=[7, 2, 9], num_tokens=10)
    with pytest.raises(TokenIndexError, match="outside the sequence"):
        pt.locate(token)


@pytest.mark.parametrize("bs", [0, -4, 1.5, None])
def test_bad_block_size(bs):
    with pytest.raises(ConfigError):
        PageTable(bs)


def test_too_many_tokens_for_the_blocks():
    with pytest.raises(ConfigError, match="do not fit"):
        PageTable(4, blocks=[1], num_tokens=5)


def test_slots_of_is_vectorized_lookup():
    blocks = np.array([3, 0, 5])
    assert slots_of(blocks, np.array([0, 3, 4, 11]), 4).tolist() == [12, 15, 0, 23]
