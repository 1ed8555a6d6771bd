"""How long a server that answered 429 or 503 asked to be left alone: its `Retry-After` header.

A server that rate-limits (429) or is down for a while (503) may say when to come back, in
seconds or as an HTTP date (RFC 9110, 10.2.3). The doubling backoff alone came back sooner, and
a rate limit counts the early attempts too, so every retry of a long job could be refused.

fsspec's HTTPFileSystem raises aiohttp's ClientResponseError (its `headers`), its blocking one
requests' HTTPError (its response's `headers`); `info()` wraps either in a FileNotFoundError and
the listing walk in an `UnlistedError`, so the error's causes are looked at too, as the callers of
`_http_status.status_of` do.
"""

from __future__ import annotations

import time
from datetime import timezone

from ._http_status import status_of

__all__ = ["RETRY_AFTER_STATUS", "retry_after_s"]

# The statuses whose Retry-After says when to try again (a 3xx's says when to follow a redirect).
RETRY_AFTER_STATUS = frozenset({429, 503})


def retry_after_s(error: BaseException, now: float | None = None) -> float | None:
    """The seconds a 429 or 503 in `error` or its causes asked to wait (0 for a date already
    past), or None where none carries a Retry-After that parses: then the backoff alone waits.
    `now` (seconds since the epoch) is what a date is counted from; the clock when None."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if status_of(error) in RETRY_AFTER_STATUS:
            value = _header(error, "Retry-After")
            if value is not None:
                return _seconds(value, time.time() if now is None else now)
        error = error.__cause__ or error.__context__
    return None


def _header(error: BaseException, name: str) -> str | None:
    """The header `name` of the response `error` reports (both clients' headers ignore case)."""
    headers = getattr(error, "headers", None) or getattr(getattr(error, "response", None), "headers", None)
    return None if headers is None else headers.get(name)


def _seconds(value: str, now: float) -> float | None:
    """A Retry-After's delay-seconds (digits only) or HTTP date as seconds from `now`; None for
    anything else, which a server's typo must not turn into a wait of its own invention."""
    value = value.strip()
    if value.isascii() and value.isdigit():
        return float(value)
    import email.utils  # here, for the rare date: it imports urllib.parse, which local data never needs

    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # an HTTP date is GMT; parsedate leaves "-0000" naive
        when = when.replace(tzinfo=timezone.utc)
    return max(0.0, when.timestamp() - now)
