"""The churn policy (autograph/policy/_churn.py) on its own: when calls pass through, for how long,
and what its report row says. The engine's use of it is tested in test_slower.py."""

from types import SimpleNamespace

from autograph.policy._churn import Churn


class Cache:
    """A key cache as the policy sees it: entries with ``replays`` and ``graph``."""

    def __init__(self, churn):
        self.churn = churn
        self.entries = []

    def new_key(self, size, graphed=False):
        entry = SimpleNamespace(
            replays=1 if graphed else 0,
            graph=object() if graphed else None,
            calls=1,
            frees_reads=False,
        )
        self.entries.append(entry)
        return self.churn.new_key(self.entries, [f"mask: i64[1, {size}] cpu"])

    def graphed_key(self, replays=0):
        """A key with a graph (a served model's decode step), its replays for the test to add."""
        entry = SimpleNamespace(replays=replays, graph=object(), calls=1, frees_reads=False)
        self.entries.append(entry)
        return entry

    def pass_calls(self, n):
        """n calls through the engine's hot-path test; how many passed through."""
        passed = 0
        for _ in range(n):
            if self.churn.left > 0:
                self.churn.left -= 1
                passed += 1
        return passed


def test_calls_pass_through_after_a_window_of_new_keys_none_graphed():
    cache = Cache(Churn("f", window=4, first=8, longest=64))
    assert [cache.new_key(n) for n in range(4)] == [False, False, False, True]
    assert cache.pass_calls(20) == 8
    row = cache.churn.stats()
    assert (row.function, row.state, row.calls, row.eager_calls, row.replays) == (
        "f",
        "eager",
        8,
        8,
        0,
    )
    assert "mask: i64[1, 2] cpu became mask: i64[1, 3] cpu" in row.fallback_reason
    assert "StaticCache" in row.fallback_reason


def test_a_function_that_never_churned_has_no_row_and_never_passes():
    cache = Cache(Churn("f", window=4))
    assert [cache.new_key(n) for n in range(3)] == [False] * 3
    assert cache.pass_calls(10) == 0 and cache.churn.stats() is None


def test_a_graph_that_replays_between_new_keys_keeps_calls_keyed():
    # A served model: its decode step is graphed and replays; each prefill is a new length.
    cache = Cache(Churn("f", window=4))
    decode = cache.graphed_key()
    for n in range(20):
        decode.replays += 5
        assert not cache.new_key(n)
    assert cache.churn.left == 0


def test_each_look_that_meets_a_new_key_doubles_the_pass_up_to_the_longest():
    cache = Cache(Churn("f", window=2, first=4, longest=16))
    cache.new_key(0)
    lengths = []
    for n in range(1, 6):
        assert cache.new_key(n)  # the look after each pass-through made a new key again
        lengths.append(cache.pass_calls(100))
    assert lengths == [4, 8, 16, 16, 16]
    assert cache.churn.looks == 4 and cache.churn.calls_passed() == 60
    assert "4 look(s)" in cache.churn.stats().fallback_reason


def test_keys_that_settle_after_a_look_are_keyed_and_a_replay_starts_the_count_over():
    cache = Cache(Churn("f", window=2, first=4, longest=16))
    cache.new_key(0)
    assert cache.new_key(1) and cache.pass_calls(10) == 4
    # The look meets known keys: the policy hears nothing and calls stay keyed.
    assert cache.pass_calls(10) == 0
    assert "keying again since a look" in cache.churn.stats().fallback_reason
    # One of them is captured and replays: the next new key starts a new count.
    cache.entries[0].graph, cache.entries[0].replays = object(), 3
    assert not cache.new_key(2)
    assert cache.new_key(3)  # a full window again, and the first pass length again
    assert cache.pass_calls(100) == 4


def test_a_negative_count_left_by_racing_threads_ends_the_pass_through():
    cache = Cache(Churn("f", window=1, first=4))
    assert cache.new_key(0)
    cache.churn.left = -1  # two threads both took the last pass-through call
    assert cache.pass_calls(3) == 0
    assert cache.churn.calls_passed() == 4


def test_reset_forgets_everything():
    cache = Cache(Churn("f", window=1, first=4))
    cache.new_key(0)
    cache.churn.reset()
    assert cache.churn.left == 0 and cache.churn.stats() is None
    assert cache.churn.last_change is None and cache.churn.streak == 0


def test_keys_that_die_before_they_repeat_pass_through_after_two():
    # A new object per call (HF generate(cache_implementation="static") and its StaticCache):
    # each key dies unused, so the window of 16 is not waited for.
    cache = Cache(Churn("f", window=16, first=8))
    died = SimpleNamespace(graph=None, calls=1, replays=0, frees_reads=False)
    assert not cache.new_key(1)
    cache.churn.key_died(died)
    assert not cache.new_key(1)
    cache.churn.key_died(died)
    assert cache.new_key(1)
    assert cache.pass_calls(20) == 8
    row = cache.churn.stats()
    assert "2 of them died before they were called again" in row.fallback_reason
    assert "Pass the same object on every call" in row.fallback_reason
    assert "the same readable key" in cache.churn.warning("x: f32[2] cpu")


def test_a_replay_between_dying_keys_keeps_calls_keyed():
    # A request-scoped cache: its prefill's key dies, but its decode step's graph replays.
    cache = Cache(Churn("f", window=16))
    decode = cache.graphed_key()
    for n in range(10):
        decode.replays += 5
        cache.churn.key_died(SimpleNamespace(graph=None, calls=1, replays=0, frees_reads=False))
        assert not cache.new_key(n)
    assert cache.churn.left == 0 and cache.churn.stats() is None


def test_a_key_that_replayed_and_died_with_its_object_resets_the_count():
    # Its replays leave the cache with it, before the next new key could see them.
    cache = Cache(Churn("f", window=16))
    for n in range(10):
        cache.churn.key_died(
            SimpleNamespace(graph=None, calls=1, replays=0, frees_reads=False)
        )  # a prefill
        cache.churn.key_died(
            SimpleNamespace(graph=object(), calls=9, replays=8, frees_reads=False)
        )  # its decode
        assert not cache.new_key(n)
    assert cache.churn.died_unused == 0


def test_keys_never_called_or_gone_eager_after_recaptures_do_not_count():
    cache = Cache(Churn("f", window=16))
    for n in range(5):
        cache.churn.key_died(
            SimpleNamespace(graph=object(), calls=0, replays=0, frees_reads=False)
        )  # capture()d
        # recaptured, then eager
        cache.churn.key_died(SimpleNamespace(graph=None, calls=3, replays=2))
        # eager once its watched warmups saw it free what it reads: no capture, no replay
        cache.churn.key_died(SimpleNamespace(graph=None, calls=3, replays=0, frees_reads=True))
        assert not cache.new_key(n)
    assert cache.churn.died_unused == 0


def test_the_row_stays_with_its_count_once_a_replay_ends_the_episode():
    cache = Cache(Churn("f", window=2, first=4))
    cache.new_key(0), cache.new_key(1)
    assert cache.pass_calls(10) == 4
    cache.graphed_key(replays=3)  # a graph replays
    assert not cache.new_key(2)  # the look's new key: the episode is over
    row = cache.churn.stats()
    assert row.calls == 4 and "ended when a graph replayed" in row.fallback_reason


def test_a_key_that_replayed_dying_during_a_pass_through_ends_it_at_once():
    # KeyCache.stats() forgets dead keys too, so a key can die while calls pass through.
    cache = Cache(Churn("f", window=2, first=8))
    cache.new_key(0), cache.new_key(1)
    assert cache.pass_calls(3) == 3
    cache.churn.key_died(SimpleNamespace(graph=object(), calls=9, replays=8, frees_reads=False))
    assert cache.pass_calls(10) == 0
    row = cache.churn.stats()
    assert row.calls == 3 and "ended when a graph replayed" in row.fallback_reason


def growing(n, ids="ids: i64[1, 1] cpu"):
    """A decode step's key: its ids kept, its attention mask ``n`` long."""
    return [ids, f"mask: i64[1, {n}] cpu", "use_cache=True"]


def test_a_key_that_grows_by_one_while_another_argument_keeps_its_shape_passes_after_three():
    churn = Churn("f", window=16, first=8)
    assert [churn.new_key([], growing(n)) for n in (9, 10, 11)] == [False, False, True]
    assert churn.left == 8 and churn.growing == 2
    assert "mask: i64[1, 10] cpu became mask: i64[1, 11] cpu" in churn.warning("k")


def test_what_is_not_growth_by_one_waits_for_the_window():
    cases = {
        "a sweep over batch sizes": lambda n: [f"ids: i64[{n}, 8] cpu", f"mask: i64[{n}, 8] cpu"],
        "no tensor kept": lambda n: [f"mask: i64[1, {n}] cpu", "use_cache=True"],
        "growth by two": lambda n: growing(2 * n),
        "two dims grow": lambda n: ["ids: i64[1, 1] cpu", f"mask: i64[{n}, {n}] cpu"],
        "another dtype": lambda n: [
            "ids: i64[1, 1] cpu",
            f"mask: {'i64' if n % 2 else 'f32'}[1, {n}] cpu",
        ],
        "shrinks": lambda n: growing(100 - n),
        "a number changes too": lambda n: growing(n) + [f"step={n}"],
    }
    for name, parts in cases.items():
        churn = Churn("f", window=6)
        assert [churn.new_key([], parts(n)) for n in range(1, 7)] == [False] * 5 + [True], name


def test_after_a_pass_through_that_growth_started_a_longer_key_passes_through_at_once():
    churn = Churn("f", window=16, first=4, longest=16)
    for n in (9, 10, 11):
        churn.new_key([], growing(n))
    churn.left = 0  # the 4 calls passed through, growing the mask unseen
    assert churn.new_key([], growing(16))  # the look's first key: 5 longer, at once again
    assert churn.left == 8 and churn.looks == 1
    churn.left = 0
    assert not churn.new_key([], growing(8, ids="ids: i64[1, 8] cpu"))  # a new prompt's prefill
    assert churn.growing == 0


def test_growth_no_longer_counts_once_a_key_was_called_twice():
    churn = Churn("f", window=16)
    called_twice = [SimpleNamespace(replays=0, graph=None, calls=2)]
    assert [churn.new_key(called_twice, growing(n)) for n in (9, 10, 11, 12)] == [False] * 4
    assert churn.growing == 0


def test_a_look_whose_key_did_not_grow_by_the_calls_passed_is_not_growth():
    churn = Churn("f", window=16, first=4)
    for n in (1, 2, 3):
        churn.new_key([], growing(n))
    churn.left = 0  # 4 calls passed: a family growing by one would be at 8 now
    assert not churn.new_key([], growing(4))  # a sweep's next size: keyed, watched
    assert churn.growing == 0
