"""Host-side page allocator with content-addressed prefix caching (plain Python, no jax).

Pages are reference counted. A page whose count drops to zero goes to the back of an LRU free
queue but keeps its content hash, so a later request with the same prefix can take it back
(a prefix-cache hit); allocation takes from the front, evicting the oldest cached content.
A full page's key is (hash of the previous page's key, its token ids), so equal keys mean equal
prefixes (dict equality compares the tokens; only the parent hash is a digest).

With a second tier (host memory, atlasjax/kv_offload.py) the pool logs what the device must copy: a
cached page evicted (its K/V saved to the tier) and a page refilled from the tier on a lookup that runs
past the device's hits (`events`, drained by the tier before the next step is dispatched).
"""
from __future__ import annotations

from collections import OrderedDict


class PagePool:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True):
        if num_pages < 1 or page_size < 1:
            raise ValueError("num_pages and page_size must be >= 1")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_pages
        self.free_queue: OrderedDict[int, None] = OrderedDict((p, None) for p in range(num_pages))
        self.page_key: dict[int, tuple] = {}        # page -> content key (cached pages only)
        self.cached: dict[tuple, int] = {}          # content key -> page
        self.num_hit_queries = 0
        self.num_hit_pages = 0       # device and second-tier hits
        self.num_queried_pages = 0
        # pages held in host memory (`claim(keys, limit)`, `fetching(keys, limit)`, `clear()`); None: one tier
        self.second_tier = None
        self.num_second_tier_hit_pages = 0
        self.events: list[tuple[str, int, tuple]] = []   # ("evict" | "restore", page, key), second tier only

    # ---- accounting
    @property
    def num_free_pages(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - len(self.free_queue)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self.free_queue)

    # ---- allocation
    def allocate(self, n: int) -> list[int]:
        if not self.can_allocate(n):
            raise MemoryError(f"need {n} pages, {len(self.free_queue)} free")
        pages = []
        for _ in range(n):
            page, _ = self.free_queue.popitem(last=False)
            key = self.page_key.pop(page, None)
            if key is not None and self.cached.get(key) == page:
                del self.cached[key]            # evict the oldest cached content
                if self.second_tier is not None:
                    self.events.append(("evict", page, key))
            self.ref_counts[page] = 1
            pages.append(page)
        return pages

    def free(self, pages: list[int]) -> None:
        # Tail pages first, so they are evicted before the shared prefix pages.
        for page in reversed(pages):
            self.ref_counts[page] -= 1
            assert self.ref_counts[page] >= 0, f"page {page} freed twice"
            if self.ref_counts[page] == 0:
                self.free_queue[page] = None

    # ---- prefix cache
    def extend_keys(self, keys: list[tuple], token_ids, root: int = 0) -> list[tuple]:
        """Append to `keys` the keys of every further full page of token_ids (incremental). root: the first
        page's parent (`Request.cache_root`: pages computed under different LoRA adapters never match)."""
        return page_keys(keys, token_ids, self.page_size, root)

    def lookup(self, keys: list[tuple]) -> list[int]:
        """Longest run of cached pages for these full-page keys; takes a reference on each."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        for key in keys:
            page = self.cached.get(key)
            if page is None:
                break
            hits.append(page)
        for page in hits:
            if self.ref_counts[page] == 0:
                del self.free_queue[page]
            self.ref_counts[page] += 1
        restored = self._restore(keys[len(hits):])
        self.num_hit_queries += 1
        self.num_queried_pages += len(keys)
        self.num_hit_pages += len(hits) + len(restored)
        self.num_second_tier_hit_pages += len(restored)
        return hits + restored

    def fetching(self, keys: list[tuple]) -> bool:
        """True while the second tier reads pages of this prefix (past the device's hits) from disk: its request
        waits while others are admitted (`HostKVCache.fetching`)."""
        if self.second_tier is None or not self.enable_prefix_caching:
            return False
        n = 0
        while n < len(keys) and keys[n] in self.cached:
            n += 1
        return self.second_tier.fetching(keys[n:], self.num_free_pages)

    def _restore(self, keys: list[tuple]) -> list[int]:
        """The second tier's run of these keys, each in a fresh page (registered as cached, its copy logged)."""
        if self.second_tier is None or not keys:
            return []
        pages = []
        for key in keys[:self.second_tier.claim(keys, self.num_free_pages)]:
            page = self.allocate(1)[0]
            self.cached[key], self.page_key[page] = page, key
            self.events.append(("restore", page, key))
            pages.append(page)
        return pages

    def register(self, pages: list[int], keys: list[tuple], first: int, last: int) -> None:
        """Record the content (keys) of full pages [first, last) of a sequence's `pages`."""
        if not self.enable_prefix_caching:
            return
        for i in range(first, last):
            if keys[i] not in self.cached and pages[i] not in self.page_key:
                self.cached[keys[i]] = pages[i]
                self.page_key[pages[i]] = keys[i]

    def reset_prefix_cache(self, held_too: bool = False) -> None:
        """Forget the cached prompt pages no request holds (held_too: those requests hold as well, which stay theirs
        but are nobody's prefix any more), and the second tier's."""
        for page in list(self.page_key):
            if self.ref_counts[page] == 0 or held_too:
                key = self.page_key.pop(page)
                self.cached.pop(key, None)
        if self.second_tier is not None:
            self.second_tier.clear()


def cache_root(lora_request=None, cache_salt: str | None = None) -> int:
    """The parent key of a request's first page: 0 for the base model and no salt (the shared cache)."""
    if lora_request is None and cache_salt is None:
        return 0
    return hash(("root", lora_request, cache_salt))


def page_keys(keys: list[tuple], token_ids, page_size: int, root: int = 0) -> list[tuple]:
    """`PagePool.extend_keys` for a page size (also what the data-parallel router keys prompts by)."""
    for i in range(len(keys), len(token_ids) // page_size):
        parent = hash(keys[-1]) if keys else root
        keys.append((parent, tuple(token_ids[i * page_size:(i + 1) * page_size])))
    return keys
