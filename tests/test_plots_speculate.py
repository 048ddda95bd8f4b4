"""The rollback picture draws a patch per slot and refuses what it cannot draw."""
import matplotlib
import pytest

matplotlib.use("Agg")

from pagedkv.plots.speculate import draw_rewind  # noqa: E402

PANEL = dict(title="after", cells=[("a", "verified")] * 5 + [("b", "kept"), ("c", "rejected")],
             table=[3, 7], named=[0], freed=[9])


def test_a_patch_per_slot():
    fig = draw_rewind([PANEL], 4)
    ax = fig.axes[0]
    assert len(ax.patches) == 3 * 4                    # two blocks mapped, one freed
    texts = [t.get_text() for t in ax.texts]
    assert "block 3, named" in texts and "block 9: freed" in texts


@pytest.mark.parametrize("bad, words", [
    (dict(PANEL, cells=[("a", "verified")] * 9), "do not fit"),
    (dict(PANEL, cells=[("a", "lost")]), "unknown slot kinds"),
])
def test_refusals(bad, words):
    with pytest.raises(ValueError, match=words):
        draw_rewind([bad], 4)
    with pytest.raises(ValueError, match="no panels"):
        draw_rewind([], 4)


def test_speedups_draw_a_bar_per_workload_and_batch():
    from pagedkv.plots.speculate import draw_speedups
    results = {"repeat": {"1": {"default": {"speedup": 1.8}}, "8": {"default": {"speedup": 1.3}}},
               "chat": {"1": {"default": {"speedup": 0.9}}, "8": {"default": {"speedup": 1.0}}}}
    fig = draw_speedups({"CPU": results, "H100": results})
    assert [len(ax.patches) for ax in fig.axes] == [4, 4]
    with pytest.raises(ValueError, match="no runs"):
        draw_speedups({})
