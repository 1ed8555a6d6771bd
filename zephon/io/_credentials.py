"""An object store's client that found no credentials to sign its requests with.

s3fs signs with what botocore finds (its environment variables, a profile, an instance role) and,
finding nothing, raises botocore's NoCredentialsError, or PartialCredentialsError for a key without
its secret. Neither is an OSError: listing a dataset ended with botocore's own message, though no
retry can mend it and the operator's remedy (credentials, or `anon` for a public bucket) is known.
An error of botocore means botocore is imported, so it is looked up in sys.modules, never imported.
"""

from __future__ import annotations

import sys

from .._errors import ConfigurationError

__all__ = ["missing_credentials", "no_credentials_for"]

_MISSING = ("NoCredentialsError", "PartialCredentialsError")


def missing_credentials(error: BaseException) -> bool:
    """Whether `error` is botocore's finding of no (or half the) credentials."""
    exceptions = sys.modules.get("botocore.exceptions")
    return any(isinstance(error, getattr(exceptions, name, ())) for name in _MISSING)


def no_credentials_for(url: str, error: BaseException) -> ConfigurationError:
    """The error for `url`, whose store's client found no credentials (`error`)."""
    return ConfigurationError(
        f"{url} may not be listed: its client found no credentials ({type(error).__name__}: {error}); set them as "
        "the store expects (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, an instance role) or in "
        "storage_options ({'key': ..., 'secret': ...}), or pass storage_options={'anon': True} for a public bucket"
    )
