"""SHA-256 for the small digests every loader process takes, without loading OpenSSL.

Recipe fingerprints, checkpoint digests, random-stream keys and the tokenizer's identity are
SHA-256 of a few bytes to a few MiB. `hashlib` imports `_hashlib`, which maps OpenSSL's libcrypto:
+3.7 MiB of PSS in a 3.14t process that has NumPy and tokenizers loaded, for those few bytes.
CPython builds its own SHA-256 in (`_sha2` from 3.12, `_sha256` in 3.11; the one the standard
library's `random` imports for the same reason), and it gives the same digests.

It is slower than OpenSSL's (285 vs 1,609 MB/s on this project's 2-core machine), which only
matters for bulk data: `Batch.digest`, which hashes whole tensors, imports `hashlib` when called,
and so does the fingerprint of an array of 1 MiB or more (`_fingerprint._digest_in_place`).
"""

from __future__ import annotations

try:
    from _sha2 import sha256  # CPython >= 3.12
except ImportError:
    try:
        from _sha256 import sha256  # CPython 3.11
    except ImportError:  # an interpreter without the built-in module
        from hashlib import sha256

__all__ = ["sha256"]
