"""tests/conftest.py's order for pytest-xdist: each worker's first batch starts with its share of the long tests."""
from conftest import deal_long_tests


def first_batches(order, workers, maxschedchunk=None):
    """What xdist's `--dist load` scheduler sends each worker first (xdist/scheduler/load.py `schedule`): blocks of
    N // workers // 4 consecutive tests (at most maxschedchunk, at least 2)."""
    chunk = max(min(len(order) // workers // 4, maxschedchunk or len(order)), 2)
    return [order[w * chunk:(w + 1) * chunk] for w in range(workers)]


def test_long_tests_are_dealt_to_every_workers_first_batch():
    items = [f"long{i}" for i in range(5)] + [f"t{i}" for i in range(95)]      # sorted: the long ones first
    long = [name.startswith("long") for name in items]
    order = deal_long_tests(items, long, 2)
    assert sorted(order) == sorted(items) and len(order) == len(items)
    a, b = first_batches(order, 2)
    assert a[:3] == ["long0", "long2", "long4"] and b[:2] == ["long1", "long3"]
    assert [t for t in order if t.startswith("t")] == [f"t{i}" for i in range(95)]   # the rest keep their order
    a, b, c = first_batches(deal_long_tests(items, long, 3, maxschedchunk=4), 3, maxschedchunk=4)
    assert (a[:2], b[:2], c[:1]) == (["long0", "long3"], ["long1", "long4"], ["long2"])


def test_more_long_tests_than_a_first_batch_leaves_the_order():
    items = [f"long{i}" for i in range(30)] + [f"t{i}" for i in range(10)]
    assert deal_long_tests(items, [name.startswith("long") for name in items], 2) == items
