"""The KV pool's page count on a GPU is stable across starts, so restarts reuse compiled programs."""
from atlasjax.kv_budget import stable_page_count


def test_page_count_is_stable_under_small_jitter():
    # a few MB more or less free memory from one start to the next: the same pool shape
    base = 30_000                                   # ~60 GiB of 2 MiB pages (8B shapes on an H100)
    counts = {stable_page_count(base + d) for d in range(0, 200, 7)}
    assert len(counts) == 1


def test_page_count_rounds_down_by_little():
    for pages in (1, 2, 63, 64, 65, 1000, 30_000, 45_260, 1 << 20):
        got = stable_page_count(pages)
        assert got <= pages                         # never more than fits
        assert got >= pages * (1 - 1 / 32)          # at most ~3% of the pool given up
        assert stable_page_count(got) == got        # a rounded count stays put
