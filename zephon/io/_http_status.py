"""What an HTTP failure under fsspec says: its status, and whether that is a denial or worth a retry.

fsspec's HTTPFileSystem raises aiohttp's ClientResponseError (its `status`), and its blocking one
requests' HTTPError, an OSError (its response's `status_code`); the `info()` of either wraps any
failure, a 403 or a 503 as well as a 404, in a FileNotFoundError whose cause is the client's
error. The status is what tells a denial, a server that cannot answer now and nothing there apart.
"""

from __future__ import annotations

from http import HTTPStatus

from .._errors import ConfigurationError

__all__ = ["DENIED_STATUS", "TRANSIENT_STATUS", "denied", "refused_by_its_server", "status_of"]

DENIED_STATUS = frozenset({401, 403})
# A status that says "try again"; any other (a 403, a 416) stays as it is.
TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})


def status_of(error: BaseException | None) -> int | None:
    """The HTTP status `error` reports, None for an error that carries none."""
    return getattr(error, "status", None) or getattr(getattr(error, "response", None), "status_code", None)


def denied(error: BaseException | None) -> bool:
    """Whether `error` is a denial, which waiting does not lift: PermissionError (sftp, smb), or
    an HTTP 401 or 403."""
    return isinstance(error, PermissionError) or status_of(error) in DENIED_STATUS


def refused_by_its_server(what: str, status: int) -> ConfigurationError:
    """The error for a file (`what` names it) whose server denied it with `status`, at once: a
    denial lasts until the credentials or the server's permissions change."""
    return ConfigurationError(
        f"{what} may not be read: its server answered HTTP {status} ({HTTPStatus(status).phrase}); check the "
        "credentials or headers in storage_options, a signed URL's expiry, or the server's permissions (a server "
        "that hides what it does not have, as S3 and CloudFront do, answers 403 for a wrong URL too)"
    )
