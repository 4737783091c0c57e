"""Stored /v1/responses (`store: true`), for `previous_response_id`, GET and DELETE.

Bounded memory: at most MAX_RESPONSES entries and MAX_CHARS characters of conversation, the least
recently used dropped first. Each entry belongs to the credential that created it (a hash of the
API key or bearer token the client sent, "" for none): another credential sees no such id.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass

MAX_RESPONSES = 1024
MAX_CHARS = 64 << 20


@dataclass(slots=True)
class StoredResponse:
    scope: str
    body: dict  # the response object, as GET returns it
    messages: list[dict]  # the conversation with this response's output, chat-shaped
    num_chars: int


def scope_of(credential: str | None) -> str:
    return "" if not credential else hashlib.sha256(credential.encode()).hexdigest()


class ResponseStore:
    def __init__(self, max_responses: int = MAX_RESPONSES, max_chars: int = MAX_CHARS) -> None:
        self.max_responses, self.max_chars = max_responses, max_chars
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.num_chars = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, scope: str, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is None or entry.scope != scope:
            return None
        self._entries.move_to_end(response_id)
        return entry

    def put(self, scope: str, response_id: str, body: dict, messages: list[dict]) -> None:
        num_chars = len(json.dumps(messages)) + len(json.dumps(body))
        if num_chars > self.max_chars:
            return  # too large to keep at all
        self.delete(scope, response_id)
        self._entries[response_id] = StoredResponse(scope, body, messages, num_chars)
        self.num_chars += num_chars
        while len(self._entries) > self.max_responses or self.num_chars > self.max_chars:
            _, old = self._entries.popitem(last=False)
            self.num_chars -= old.num_chars

    def delete(self, scope: str, response_id: str) -> bool:
        entry = self._entries.get(response_id)
        if entry is None or entry.scope != scope:
            return False
        del self._entries[response_id]
        self.num_chars -= entry.num_chars
        return True
