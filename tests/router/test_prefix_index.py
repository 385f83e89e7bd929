"""The router's prefix index and cache-aware choice, without servers: longest cached prefix per backend from
events and from what was sent, predictions that lapse, a bounded approximate mode, and the sticky rule."""

from __future__ import annotations

from splitserve.engine.page_hash import page_hashes
from splitserve.router.cache_aware import LoadTokens, choose
from splitserve.router.prefix_index import PrefixIndex


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def events(epoch: str, seq: int, stored: list[int], removed: list[int] = (), reset: bool = False) -> dict:
    ops = [["stored", "device", list(stored)]] if stored else []
    ops += [["removed", "device", list(removed)]] if removed else []
    return {"epoch": epoch, "seq": seq, "page_size": 4, "hash_version": 1, "reset": reset, "events": ops}


def test_match_counts_each_backend_s_longest_run_of_leading_pages() -> None:
    index = PrefixIndex()
    prompt = page_hashes(list(range(40)), 4)  # 10 pages
    other = page_hashes([7, *range(1, 40)], 4)
    index.apply_events("a", events("e", 1, prompt[:6], reset=True))
    index.apply_events("b", events("e", 1, prompt[:2] + prompt[3:10], reset=True))  # a gap at page 2
    index.apply_events("c", events("e", 1, other, reset=True))
    assert index.match(prompt, ["a", "b", "c", "d"]) == {"a": 6, "b": 2, "c": 0, "d": 0}
    index.apply_events("a", events("e", 2, prompt[6:], removed=[prompt[0]]))
    assert index.match(prompt, ["a", "b"]) == {"a": 0, "b": 2}  # a lost the first page: nothing leads
    index.apply_events("a", events("f", 1, prompt, reset=True))  # a restarted and reports everything
    assert index.match(prompt, ["a"]) == {"a": 10}
    index.forget("a")
    assert index.match(prompt, ["a", "b"]) == {"a": 0, "b": 2}


def test_a_reset_replaces_what_a_backend_reported_but_keeps_its_predictions() -> None:
    clock = FakeClock()
    index = PrefixIndex(prediction_ttl_s=5.0, clock=clock)
    prompt = page_hashes(list(range(32)), 4)
    index.apply_events("a", events("e", 3, prompt[:4], reset=True))
    index.sent("a", prompt[:8])
    index.apply_events("a", events("e", 4, [], reset=True))  # its cache was flushed
    assert index.match(prompt, ["a"]) == {"a": 8}  # the prompt just sent is still predicted there
    clock.now = 6.0  # an exact backend's predictions lapse once its events had time to tell
    assert index.match(prompt, ["a"]) == {"a": 0}
    assert index.cursor("a") == ("e", 4) and index.publishes("a")


def test_the_approximate_mode_keeps_the_most_recently_sent_pages_within_its_bound() -> None:
    clock = FakeClock()
    index = PrefixIndex(approximate_pages=10, clock=clock)
    first, second = page_hashes(list(range(32)), 4), page_hashes(list(range(100, 132)), 4)
    index.sent("x", first)
    clock.now = 1000.0  # predictions of a backend without events do not lapse with time ...
    assert index.match(first, ["x"]) == {"x": 8}
    index.sent("x", second)  # ... but the oldest go past the bound
    assert index.pages("x") == 10
    assert index.match(second, ["x"]) == {"x": 8} and index.match(first, ["x"]) == {"x": 0}


def test_the_sticky_rule_prefers_the_longest_prefix_until_its_backend_is_saturated() -> None:
    load = LoadTokens()
    candidates = [("a", 0), ("b", 0), ("c", 0)]
    cached = {"a": 10, "b": 3}
    choice = choose(candidates, cached, 16, prompt_tokens=200, load=load, max_load_tokens=1000)
    assert (choice.url, choice.cached_tokens, choice.reason) == ("a", 160, "cache")
    release = load.add("a", 990)
    assert choose(candidates, cached, 16, 200, load, 1000).url == "a"  # under the bound: still sticky
    load.add("a", 20)
    saturated = choose(candidates, cached, 16, 200, load, 1000)
    assert (saturated.url, saturated.reason) == ("b", "load")  # least added work: 200 - 48 + 0
    release()
    release()  # idempotent
    assert load["a"] == 20


def test_an_uncached_prompt_goes_where_it_adds_least_to_the_queue() -> None:
    load = LoadTokens()
    load.add("a", 500)
    load.add("b", 100)
    choice = choose([("a", 1), ("b", 5), ("c", 0)], {}, 16, 300, load, 1000)
    assert (choice.url, choice.cached_tokens, choice.best_cached_tokens) == ("c", 0, 0)
    # the whole prompt cached leaves its last token to compute: never predict more than prompt - 1
    assert choose([("a", 0)], {"a": 100}, 16, 64, LoadTokens(), 1000).cached_tokens == 63


def test_a_page_moved_to_the_host_tier_still_counts_and_leaves_with_its_last_tier() -> None:
    index = PrefixIndex()
    prompt = page_hashes(list(range(40)), 4)
    index.apply_events("a", events("e", 1, prompt, reset=True))
    moved = {"epoch": "e", "seq": 2, "page_size": 4, "hash_version": 1, "reset": False,
             "events": [["removed", "device", prompt[5:]], ["stored", "host", prompt[5:]]]}
    index.apply_events("a", moved)
    assert index.match(prompt, ["a"]) == {"a": 10}  # in host memory: a load away, still held
    assert index.tier_pages("a") == {"device": 5, "host": 5}
    index.apply_events("a", {**moved, "seq": 3, "events": [["removed", "host", prompt[8:]]]})
    assert index.match(prompt, ["a"]) == {"a": 8}
    reset = {**moved, "seq": 4, "reset": True, "events": [["stored", "host", prompt[:2]]]}
    index.apply_events("a", reset)
    assert index.match(prompt, ["a"]) == {"a": 2} and index.tier_pages("a") == {"host": 2}


def store_events(epoch: str, seq: int, store: str | None, tiers: dict[str, list[int]], op: str = "stored",
                 reset: bool = False) -> dict:
    return {"epoch": epoch, "seq": seq, "page_size": 4, "hash_version": 1, "reset": reset, "store": store,
            "events": [[op, tier, list(hashes)] for tier, hashes in tiers.items()]}


def test_store_pages_count_for_every_backend_on_that_store_and_weigh_less_than_held_ones() -> None:
    index = PrefixIndex()
    prompt = page_hashes(list(range(40)), 4)  # 10 pages
    index.apply_events("a", store_events("ea", 1, "s1", {"device": prompt[:2], "store": prompt[:8]}, reset=True))
    index.apply_events("b", store_events("eb", 1, "s1", {"device": []}, reset=True))
    index.apply_events("c", store_events("ec", 1, "s2", {"host": prompt[:3]}, reset=True))
    index.apply_events("d", store_events("ed", 1, None, {"device": []}, reset=True))
    urls = ["a", "b", "c", "d"]
    depth = index.match(prompt, urls)
    assert depth == {"a": 2, "b": 0, "c": 3, "d": 0}  # store pages are no backend's own
    reach = index.store_match(prompt, depth)
    assert reach == {"a": 8, "b": 8, "c": 3, "d": 0}  # b reaches a's store pages; c's store has none of them
    assert index.tier_pages("a") == {"device": 2, "store": 8}
    # Worth: a 2 + 6 * 0.5 = 5 pages, b 4, c 3, d 0: a is sticky, and the choice predicts its whole reach.
    candidates = [(u, 0) for u in urls]
    choice = choose(candidates, depth, 4, prompt_tokens=40, load=LoadTokens(), max_load_tokens=1000,
                    store_pages=reach)
    assert (choice.url, choice.cached_tokens, choice.best_cached_tokens, choice.reason) == ("a", 32, 32, "cache")
    # Without a's device pages, b (store only) beats c (3 held pages) only with enough store pages: 8 * 0.5 > 3.
    without_a = [("b", 0), ("c", 0), ("d", 0)]
    assert choose(without_a, depth, 4, 40, LoadTokens(), 1000, store_pages=reach).url == "b"
    short = index.store_match(prompt[:5], index.match(prompt[:5], urls))
    assert short["b"] == 5 and choose(without_a, depth, 4, 20, LoadTokens(), 1000, store_pages=short).url == "c"
    # A page another backend reported in the store counts until the last reporter removes it.
    index.apply_events("b", store_events("eb", 2, "s1", {"store": prompt[4:6]}))
    index.apply_events("a", store_events("ea", 2, "s1", {"store": prompt[4:]}, op="removed"))
    assert index.store_match(prompt, index.match(prompt, urls))["b"] == 6
    index.forget("b")
    assert index.store_match(prompt, index.match(prompt, urls))["a"] == 4
    # A reset drops what it reported in the store too.
    index.apply_events("a", store_events("ea2", 1, "s1", {"device": prompt[:1]}, reset=True))
    assert index.store_match(prompt, index.match(prompt, urls))["a"] == 1 and index._stores == {}
