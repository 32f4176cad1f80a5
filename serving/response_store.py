"""Stored responses of the Responses API (`store`, on by default as OpenAI's): what `GET
/v1/responses/{id}` returns and what `previous_response_id` continues.

In the server's memory, least recently used first out past `--max-stored-responses` (0 stores none),
lost on restart. Each entry keeps the response object, its request's input items (GET
/v1/responses/{id}/input_items) and the conversation so far as chat messages:
the earlier turns, this request's input and its answer (its text, not its reasoning), without the
request's `instructions`, which a chained request does not inherit.
"""
from __future__ import annotations

import collections
import dataclasses

DEFAULT_MAX_STORED = 1024


@dataclasses.dataclass(frozen=True)
class StoredResponse:
    response: dict
    conversation: tuple[dict, ...]
    input_items: tuple[dict, ...] = ()   # the request's own input, as message items with ids


class ResponseStore:
    def __init__(self, max_entries: int = DEFAULT_MAX_STORED):
        if max_entries < 0:
            raise ValueError(f"max_entries must be >= 0, got {max_entries}")
        self.max_entries = max_entries
        self._entries: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict, conversation: list[dict], input_items: list[dict] = ()) -> None:
        if not self.enabled:
            return
        self._entries[response["id"]] = StoredResponse(response, tuple(conversation), tuple(input_items))
        self._entries.move_to_end(response["id"])
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None
